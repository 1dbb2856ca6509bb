"""Token families: token files (``tokens``; written by ``python -m ddp_utils.prepare_text``
from text, ``text``), Python's standard library as a corpus (``pystdlib``), and the
tokenizers they share (``tokenizer``)."""
