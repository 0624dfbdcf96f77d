"""Hugging Face interchange formats: native GPT-2 / Llama configs and weight layouts
(`native.py`), the wrapper that the other families' exports carry (`modeling.py`), and reading
Hugging Face directories back into our models (`load.py`: `model.init_from`, `load_trained`).
Writing exports is `pretrain.training.export_hf`, above the loading of trained models."""
