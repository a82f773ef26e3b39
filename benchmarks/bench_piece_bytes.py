"""What packed rows pay to record each document's example (``example_ids``, ``piece_offsets``, ``example_loss``):
Arrow bytes of those columns against the rows' token bytes and the parquet file, on real chat lengths
(ShareGPT under Qwen3's tokenizer, ``data/sharegpt_qwen3_lengths.npy``) packed at ``--window`` with
``overflow="split"`` (the columns are written whenever an example is split). Prints one line and one JSON line.
``python benchmarks/bench_piece_bytes.py [--examples N] [--window W]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
from benchlib import chat_lengths, versions

from packkit.offline import pack_dataset
from packkit.rules import DOCUMENT_KEYS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=2048)
    args = parser.parse_args(argv)
    import datasets

    lengths = chat_lengths(args.examples, seed=0)
    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict({"input_ids": [rng.integers(0, 151_000, int(n)).astype(np.int32) for n in lengths]})
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.parquet")
        _, plan = pack_dataset(ds, window=args.window, seed=0, output=out, return_report=True)
        parquet = os.path.getsize(out)
        table = pack_dataset(ds, window=args.window, seed=0).data.table
    extra = sum(table.column(c).nbytes for c in DOCUMENT_KEYS)
    tokens = table.column("input_ids").nbytes
    rec = {"bench": "piece_bytes", "examples": int(lengths.size), "documents": plan.num_segments,
           "rows": plan.num_windows, "split_examples": int(plan.split_examples.size), "document_bytes": extra,
           "bytes_per_example": extra / lengths.size, "bytes_per_document": extra / plan.num_segments,
           "token_bytes": tokens, "parquet_bytes": parquet, **versions("pyarrow", "datasets")}
    print(f"{rec['examples']:,} examples ({rec['split_examples']:,} split) -> {rec['documents']:,} documents in "
          f"{rec['rows']:,} rows of W={args.window}: the document columns {extra:,} B of Arrow "
          f"({rec['bytes_per_example']:.1f} B an example, {rec['bytes_per_document']:.1f} B a document: 16 B a "
          f"document + 12 B a row of list offsets), {extra / tokens:.2%} of the token column, parquet file "
          f"{parquet:,} B")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
