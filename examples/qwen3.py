"""Greedy decoding of a Qwen3 model, one megakernel launch per token.

    python examples/qwen3.py --random-weights                              # the qwen3-tiny preset
    python examples/qwen3.py --preset qwen3-0.6b --random-weights --max-new-tokens 16
    python examples/qwen3.py --model /path/to/Qwen3-0.6B --prompt "Hello"

Text streams to stdout as it is generated (until EOS unless --ignore-eos); --json adds one
JSON object as the last line. See docs/models.md.
"""

from megaegg.models.cli import main

if __name__ == "__main__":
    main("qwen3")
