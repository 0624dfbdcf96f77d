"""Hugging Face interchange: exports of trained models (`export.py`; native GPT-2 / Llama in
`native.py`, the wrapper that other families carry in `modeling.py`) and reading Hugging Face
directories back into our models (`load.py`: `model.init_from`, `load_trained`)."""
