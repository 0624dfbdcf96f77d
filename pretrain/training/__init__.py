"""The machinery that the commands at pretrain's root drive: the training loop and its parts (the
DeepSpeed engine, the optimizer, checkpoints, evaluation, metrics, stop signals, the run's lock,
the checks before a launch), the memory plan, and a trained model's loading, descent measures and
Hugging Face export."""
