"""llama.cpp's GGUF files: the header (header.py, checked against the file's size), the model's
config and metadata (reader.py, model.py), its tokenizer (tokenizer.py), its weights kept in their
blocks (weights.py), and `nanoserve import-model` (importer.py)."""
