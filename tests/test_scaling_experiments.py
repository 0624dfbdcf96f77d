"""The experiments' scoring: the prompt/answer alignment of ListOps greedy and teacher-forced
accuracy, checked against a real (untrained) model's own greedy continuations."""
import json

import torch

from pretrain import models
from pretrain.scaling.experiments.common import cached
from pretrain.scaling.experiments.listops import greedy_accuracy, teacher_forced

EOS = 1


def _model_and_examples():
    torch.manual_seed(0)
    model = models.build(models.resolve("gpt_rec-listops-w16", {"vocab_size": 20})).eval()
    prompts = [[5, 3, 8, 9, 4, 2], [6, 3, 10, 11, 12, 4, 2], [7, 3, 8, 4, 2], [5, 3, 9, 9, 4, 2]]
    examples = []
    for prompt in prompts:  # answers = what the model itself generates greedily
        out = model.generate(torch.tensor([[EOS] + prompt]), 5, top_k=1)[0, len(prompt) + 1:]
        examples.append((prompt, out.tolist()))
    return model, examples


def test_listops_scores_align_prompt_and_answer():
    model, examples = _model_and_examples()
    assert greedy_accuracy(model, examples, EOS)["exact"] == 1.0
    assert teacher_forced(model, examples, EOS)["answer_token_acc"] == 1.0
    # Changing one answer token in every example breaks exact match and costs one token each.
    wrong = [(p, a[:2] + [(a[2] + 1) % 20] + a[3:]) for p, a in examples]
    assert greedy_accuracy(model, wrong, EOS)["exact"] == 0.0
    scores = teacher_forced(model, wrong, EOS)
    assert scores["answer_token_acc"] < 1.0
    assert scores["answer_loss"] > teacher_forced(model, examples, EOS)["answer_loss"]


def test_cached_computes_once_per_key(tmp_path):
    calls = []
    compute = lambda: calls.append(1) or {"x": len(calls)}  # noqa: E731
    assert cached(tmp_path, "a", compute) == {"x": 1}
    assert cached(tmp_path, "a", compute) == {"x": 1} and len(calls) == 1
    assert cached(tmp_path, "b", compute) == {"x": 2}
    assert set(json.loads((tmp_path / "experiment_eval.json").read_text())) == {"a", "b"}


def test_thinking_figure_shows_a_tiny_best_of_n_difference_as_flat():
    """The best-of-N panel shares the loss scale of the steps panel and has no offset: a
    0.0003-nat difference must not fill the panel."""
    from pretrain.scaling.experiments.ebt_thinking import _figure
    from pretrain.scaling.plots import pyplot

    losses = [7.125, 6.029, 5.760, 5.923, 5.794, 5.909]
    steps_rows = [{"steps": k + 1, "val_loss": v, "final_energy": -2.0, "eval_noise": noise}
                  for k, v in enumerate(losses) for noise in ("off", "on")]
    best_rows = [{"best_of": n, "val_loss": v, "eval_noise": noise}
                 for n, v in ((1, 5.7597), (2, 5.7596), (4, 5.7594)) for noise in ("off", "on")]
    figure = _figure(steps_rows, best_rows, (2, 3))
    ax_steps, _, ax_best = figure.axes  # steps, energy, best-of-N panels
    figure.canvas.draw()
    low, high = ax_best.get_ylim()
    assert (low, high) == ax_steps.get_ylim() and high - low > 1.0
    assert ax_best.yaxis.get_offset_text().get_text() == ""
    pyplot().close(figure)
