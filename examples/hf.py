"""Text generation with a Hugging Face causal LM through its own modelling code (megaegg.from_transformers):
its prompt and decode steps exported with torch.export and compiled into megakernels: the prompt in one
launch, then one launch a token.

    python examples/hf.py --arch mistral --random-weights --prompt-ids 1 2 3 --max-new-tokens 8   # no download
    python examples/hf.py --model /path/to/Qwen3-0.6B --prompt "The capital of France is" --json

Architectures tested on the simulator against transformers' greedy tokens: Llama, Qwen3, Qwen2, Mistral,
OLMo2 / 3, Granite, Phi-3, Gemma 1 / 2 / 3, EXAONE 4, Seed-OSS, Ministral, SmolLM3, GLM / GLM-4, Helium,
ERNIE 4.5 (tests/test_hf.py). See docs/frontend.md.
"""

from megaegg.frontend.hf_cli import main

if __name__ == "__main__":
    main()
