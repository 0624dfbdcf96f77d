"""The bottom layer: what every command of the data pipeline, the trainer and the benchmarks
shares at its edges (`cli`: argument errors, stop signals, exit codes) and with the file system
(`fileio`: atomic writes, JSON reads). It imports nothing of the project's other packages."""
