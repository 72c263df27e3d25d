"""`hipfire-bench peer-vllm`: this engine and vLLM side by side on one GPU, each in its own child
process, on the same shape, prompts and settings (`main.py` has the method)."""
