"""The MNIST model of the authors' code, rebuilt here from its description (float64, loops), against ours.

What the authors' code does (beyond-param-count, mnist_experiments; see shared/reference/authors-code-facts.md):
pixels (x - 0.1307) / 0.3081; 4 tokens of 14x14 in row-major patch order; tokens and phi's columns divided by
their L2 norm plus 1e-6, phi times a learnable scalar; the normalized tokens replace X (logits, dispatch AND slots);
dispatch = softmax over tokens, combine = softmax over slots; experts Linear(196, int(196 * 4 / n), bias=False),
ReLU, Linear(.., 196, bias=False); head Linear(784, 10, bias=False) on the flattened outputs; phi U[-1, 1].
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from softmoe.cli import MNIST_MODEL_NAMES
from softmoe.models import SoftMoEClassifier
from softmoe.models.mnist import MNIST_MODELS, expert_hidden_for

F64 = torch.float64


def authors_parameters(model: SoftMoEClassifier) -> dict:
    """Our model's parameters in the authors' layouts: phi (196, n), scale, per expert W1 (h, 196) and W2 (196, h)
    as nn.Linear stores them, head W (10, 784)."""
    experts = model.moe.experts
    return {
        "phi": model.moe.phi.detach().to(F64).reshape(model.dim, -1),
        "scale": float(model.moe.scale.detach()),
        "w1": [experts.weight1[j].detach().to(F64).t() for j in range(experts.num_experts)],
        "w2": [experts.weight2[j].detach().to(F64).t() for j in range(experts.num_experts)],
        "head": model.head.weight.detach().to(F64),
    }


def unit(v: torch.Tensor) -> torch.Tensor:
    return v / (math.sqrt(sum(float(e) ** 2 for e in v)) + 1e-6)


def authors_logits(params: dict, image: torch.Tensor) -> torch.Tensor:
    """One 28x28 image (values in [0, 1]) -> 10 logits, by loops over tokens, slots and experts."""
    pixels = (image.to(F64).reshape(28, 28) - 0.1307) / 0.3081
    tokens = []
    for r in range(2):
        for c in range(2):
            tokens.append(torch.stack([pixels[14 * r + i, 14 * c + j] for i in range(14) for j in range(14)]))
    tokens = [unit(t) for t in tokens]
    phi = params["phi"]
    slots = phi.shape[1]
    columns = [unit(phi[:, s]) * params["scale"] for s in range(slots)]
    logits = [[float(torch.dot(tokens[m], columns[s])) for s in range(slots)] for m in range(4)]
    outputs = []
    for s in range(slots):  # one slot per expert: slot s is expert s
        weights = [math.exp(logits[m][s]) for m in range(4)]
        slot = sum(w / sum(weights) * tokens[m] for m, w in enumerate(weights))
        outputs.append(params["w2"][s] @ torch.relu(params["w1"][s] @ slot))
    mixed = []
    for m in range(4):
        weights = [math.exp(logits[m][s]) for s in range(slots)]
        mixed.append(sum(w / sum(weights) * outputs[s] for s, w in enumerate(weights)))
    return params["head"] @ torch.cat(mixed)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8, 64, 512])
def test_authors_model_matches_the_rebuilt_authors_model(n):
    torch.manual_seed(n)
    model = SoftMoEClassifier((1, 28, 28), n).double().eval()
    with torch.no_grad():
        model.moe.scale.fill_(1.7)  # a trained scale, not the initial 1
    assert model.moe.experts.hidden == int(196 * (4 / n))
    images = torch.rand(3, 1, 28, 28)
    images[0, 0, :14, :14] = 0.0  # a blank patch: the normalization's epsilon matters here
    params = authors_parameters(model)
    expected = torch.stack([authors_logits(params, image) for image in images])
    with torch.no_grad():
        got = model(images.to(F64))
    assert (got - expected).abs().max().item() < 1e-10


def test_authors_model_hidden_sizes_and_parameter_count():
    """int(196 * 4 / n) truncates (n = 32: 24, n = 512: 1); no biases anywhere; the paper's 307K expert parameters."""
    assert [expert_hidden_for(196, n) for n in (2, 4, 8, 16, 32, 64, 128, 256, 512)] == [
        392, 196, 98, 49, 24, 12, 6, 3, 1,
    ]
    model = SoftMoEClassifier((1, 28, 28), 2)
    assert model.head.bias is None and model.moe.experts.bias1 is None and model.moe.experts.bias2 is None
    assert model.expert_parameter_count() == 2 * 2 * 196 * 392 == 307_328
    assert sum(p.numel() for p in model.parameters()) == 307_328 + 196 * 2 + 1 + 784 * 10


@pytest.mark.parametrize("n", [2, 16])
def test_authors_model_starts_from_the_authors_weights_for_a_seed(n):
    """Seeded alike, the authors' code (head, phi = -1 + 2 rand, then each expert's nn.Linear layers, in that order)
    and our model draw the same initial weights."""
    torch.manual_seed(0)
    head = nn.Linear(784, 10, bias=False)
    phi = -1 + 2 * torch.rand(196, n)
    hidden = int(196 * (4 / n))
    experts = [nn.Sequential(nn.Linear(196, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 196, bias=False)) for _ in range(n)]
    torch.manual_seed(0)
    model = SoftMoEClassifier((1, 28, 28), n)
    assert torch.equal(model.head.weight, head.weight)
    assert torch.equal(model.moe.phi.reshape(196, n), phi)
    for j, expert in enumerate(experts):
        assert torch.equal(model.moe.experts.weight1[j], expert[0].weight.t())
        assert torch.equal(model.moe.experts.weight2[j], expert[2].weight.t())
    assert float(model.moe.scale.detach()) == 1.0


def test_definition1_model_is_the_previous_model():
    """Equation (1) routing, biases, rounded hidden sizes, pixels in [0, 1]: the parameter counts of the earlier
    committed reports (316,746 at n = 2, 610,986 at n = 512)."""
    for n, count in ((2, 316_746), (512, 610_986)):
        model = SoftMoEClassifier((1, 28, 28), n, model="definition1")
        assert model.moe.normalize == "none" and model.moe.scale is None
        assert sum(p.numel() for p in model.parameters()) == count
    images = torch.rand(2, 1, 28, 28)
    model = SoftMoEClassifier((1, 28, 28), 4, model="definition1")
    assert torch.equal(model.tokenize(images), images.reshape(2, 1, 2, 14, 2, 14).permute(0, 2, 4, 1, 3, 5).reshape(2, 4, 196))


def test_unknown_model_name_raises():
    with pytest.raises(ValueError, match=r"unknown MNIST model 'vmoe'; choose one of \['authors', 'authors-scale10', "
                                         r"'definition1'\]"):
        SoftMoEClassifier((1, 28, 28), 4, model="vmoe")
    assert MNIST_MODEL_NAMES == tuple(sorted(MNIST_MODELS))  # the CLI's choices, named without importing torch


def test_scale10_control_is_the_authors_model_with_a_larger_scale():
    torch.manual_seed(0)
    authors = SoftMoEClassifier((1, 28, 28), 8)
    torch.manual_seed(0)
    control = SoftMoEClassifier((1, 28, 28), 8, model="authors-scale10")
    assert float(control.moe.scale.detach()) == 10.0
    for (name, mine), (_, theirs) in zip(control.named_parameters(), authors.named_parameters()):
        assert name == "moe.scale" or torch.equal(mine, theirs), name
    images = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        authors.moe.scale.fill_(10.0)
        torch.testing.assert_close(control(images), authors(images), rtol=0, atol=0)
