"""Image-label families: the embedded and torchvision sets held in memory (``in_memory``,
``builtin``), image folders and your own datasets streamed from files (``streamed``,
``imagefolder``, ``custom``), Pascal VOC's folders (``voc``), and the augmentation and
on-device normalisation they share (``transforms``, ``preprocess``)."""
