"""The machinery of a training run, which the commands (`pretrain.train` and the others) drive:
the DeepSpeed engine, the optimizer, checkpoints, metrics, stop signals, the run's lock and the
checks before a launch; and the loading of a trained model for use."""
