"""Shared by the --grad-accum tests (test_grad_accum.py, test_gloo_grad_accum.py): the planned
batch, a padded batch whose microbatches keep different counts of valid labels, and the
reference optimizers with the run.py options that match them."""
import torch

B, S, K, STEPS, LR = 4, 8, 2, 3, 1e-2


# padded label positions per row: of the 7 shifted labels per row, microbatch 1 (rows 0-3) keeps
# 6 + 7 + 5 + 7 = 25, microbatch 2 keeps 1 + 2 + 4 + 0 = 7; each data rank's half differs too
PADS = (1, 0, 2, 0, 6, 5, 3, 7)


def padded_batch(rows: int, seed: int = 5):
    """``rows`` token rows whose labels are padded (-100) at the end of each row by a different
    amount: the valid counts differ between rows, so between microbatches and data ranks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (rows, S), generator=g)
    labels = ids.clone()
    for r in range(rows):
        pad = PADS[r % len(PADS)]
        if pad:
            labels[r, S - pad:] = -100
    return ids, labels


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def sgd(params):
    """Plain SGD: the update is the gradient itself, so any error in it shows in the parameters
    (AdamW's first steps are nearly the gradient's sign, blind to an error of its scale)."""
    return torch.optim.SGD(params, lr=0.5)


# run.py's options for each reference optimizer
OPTIMIZERS = {"adamw": (["--optimizer", "adamw", "--lr", str(LR)], adamw),
              "sgd": (["--optimizer", "sgd", "--lr", "0.5"], sgd)}
