"""GGUF checkpoints (llama.cpp's single-file format): the GGML block formats dequantized by torch
(`blocks`), the model's shape and HF-named weights from a file (`checkpoint`) and its
tokenizer and chat template from the metadata (`vocab`, torch-free)."""
