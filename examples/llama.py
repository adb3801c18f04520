"""Greedy decoding of a Llama 3.x model, one megakernel launch per token.

    python examples/llama.py --preset tiny --random-weights --max-new-tokens 16
    python examples/llama.py --model /path/to/Llama-3.2-1B --prompt "The capital of France is"
"""

from megaegg.models.cli import main

if __name__ == "__main__":
    main("llama")
