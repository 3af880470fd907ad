#!/usr/bin/env python
"""Convert a Megatron checkpoint (any TP/PP) back into a Hugging Face directory.

    python tools/convert_mcore_to_hf.py MCORE_DIR OUT_DIR

Same as `specroll convert mcore-to-hf`.
"""

import sys

from specroll_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
