"""Greedy decoding of a Llama 3.x model, one megakernel launch per token.

    python examples/llama.py --random-weights --max-new-tokens 16          # the tiny preset
    python examples/llama.py --preset llama-3.2-1b --random-weights --prompt-ids 1 2 3
    python examples/llama.py --model /path/to/Llama-3.2-1B --prompt "The capital of France is"

Text streams to stdout as it is generated (until EOS unless --ignore-eos); --json adds one
JSON object as the last line. See docs/models.md.
"""

from megaegg.models.cli import main

if __name__ == "__main__":
    main("llama")
