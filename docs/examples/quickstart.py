"""Train a tiny ECP model on a text file, sample from it and score it (a minute on a CPU)."""
import argparse
from pathlib import Path

import ecp_lm

Path("corpus.txt").write_text(Path(argparse.__file__).read_text())  # any text file will do
run = ecp_lm.train("tiny", out="runs/quickstart", source="text", data_path="corpus.txt", steps=100)
print(run.generate("def parse_args(self", max_new_tokens=80))
report = run.evaluate("test")
print({key: round(report[key], 3) for key in ("loss", "ppl_token", "bits_per_byte")})
