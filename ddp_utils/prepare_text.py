"""Turn text files into token files for ``data=tokens`` (nanoGPT's layout).

    python -m ddp_utils.prepare_text OUT SRC... [--tokenizer=char|bytes|bpe] [--vocab_size=N]
                                     [--val_fraction=0.1] [--overwrite]

SRC are text files or folders of them (every file below a folder, in sorted path order). OUT
gets ``train.bin`` and ``val.bin`` (nanoGPT's split: the first ``int(n * (1 - val_fraction))``
tokens train, the rest validate; one file's tokens are byte-identical to nanoGPT's),
``meta.json`` (vocab_size, dtype, the tokenizer, the bytes of each token) and, for bpe,
``tokenizer.json``; for char also nanoGPT's ``meta.pkl`` (train.py never reads it).
A binary, non-UTF-8 or empty input, or an OUT that already holds prepared files (without
``--overwrite``), is refused with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_utils.config import UserError
from ddp_utils.data.text.text import prepare, text_files
from ddp_utils.data.text.tokenizer import TOKENIZER_KINDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_utils.prepare_text", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("sources", type=Path, nargs="+", help="text files or folders of them")
    parser.add_argument("--tokenizer", default="char", choices=TOKENIZER_KINDS)
    parser.add_argument("--vocab_size", type=int, default=None, help="bpe: the vocabulary size")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--overwrite", action="store_true", help="replace OUT's prepared files")
    args = parser.parse_args(argv)
    try:
        files = text_files(args.sources)
        meta = prepare(
            args.out,
            files,
            args.tokenizer,
            args.vocab_size,
            args.val_fraction,
            progress=sys.stderr.isatty(),
            overwrite=args.overwrite,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {meta['train_tokens']} training and {meta['val_tokens']} validation "
        f"tokens of {meta['vocab_size']} ids ({args.tokenizer}) from {len(files)} files"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
