"""Images in prompts: decoding and checking what a client sends (image.py), the vision
processor's preprocessing (processor.py), and the prompt's images as the engine carries them
(inputs.py)."""
