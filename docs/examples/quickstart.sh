#!/bin/sh
# The quickstart on the command line: a text file, its token cache, a tiny run, text, scores.
python -c "import argparse, shutil; shutil.copy(argparse.__file__, 'corpus.txt')"
ecp data prepare text --path corpus.txt
ecp train --config tiny --out runs/quickstart data.source=text data.path=corpus.txt train.steps=100
ecp generate --ckpt runs/quickstart --prompt "def parse_args(self" --max-new-tokens 80
ecp eval --ckpt runs/quickstart --split test
