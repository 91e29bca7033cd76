"""The run's activation meter counts what the planner's profiler predicts: each saved
tensor once, parameters left out, steady-state steps only."""
import torch

from hetrain.train.summary import SKIP_STEPS, ActivationMeter


def _chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5, bias=False), torch.nn.ReLU())


def _step(meter, model, x):
    with meter.of(len(x)):
        model(x).sum().backward()


def test_tiny_chain_counts_hand_computed_bytes():
    model, x = _chain(), torch.randn(4, 3)
    meter = ActivationMeter(model)
    _step(meter, model, x)
    # Linear saves its input (4x3 fp32) and its weight (a parameter: left out);
    # ReLU saves its output (4x5 fp32).
    assert meter.peak() == 4 * 3 * 4 + 4 * 5 * 4
    assert meter.per_sample() == (4 * 3 * 4 + 4 * 5 * 4) / 4


def test_parameters_are_not_counted():
    w = torch.nn.Parameter(torch.randn(6, 6))
    model = torch.nn.Module()
    model.w = w
    meter = ActivationMeter(model)
    with meter.of(1):
        (w * w).sum().backward()  # mul saves the parameter twice, nothing else
    assert meter.peak() == 0
    unfiltered = ActivationMeter()  # without the model, the same tensor counts (once)
    with unfiltered.of(1):
        (w * w).sum().backward()
    assert unfiltered.peak() == 6 * 6 * 4


def test_tensor_saved_twice_counts_once():
    x = torch.randn(8, 2, requires_grad=True)
    meter = ActivationMeter()
    with meter.of(8):
        a = torch.relu(x)  # ReLU saves a
        (a * a).sum().backward()  # mul saves a as both operands
    assert meter.peak() == 8 * 2 * 4


def test_peak_leaves_out_warm_up_steps():
    model = _chain()
    meter = ActivationMeter(model)
    sizes = [64] * SKIP_STEPS + [4, 8, 2]  # equal shares first, then balanced (smaller) ones
    for n in sizes:
        _step(meter, model, torch.randn(n, 3))
    per_sample = 3 * 4 + 5 * 4
    assert meter.peak() == 8 * per_sample
    assert meter.peak(skip=0) == 64 * per_sample
    assert meter.per_sample() == per_sample
    assert [b for b, _ in meter.steps] == [n * per_sample for n in sizes]


def test_few_steps_fall_back_to_all_and_empty_steps_count_nothing():
    model = _chain()
    meter = ActivationMeter(model)
    with meter.of(0):
        pass
    _step(meter, model, torch.randn(2, 3))
    assert len(meter.steps) == 2 <= SKIP_STEPS
    assert meter.peak() == 2 * (3 * 4 + 5 * 4)
    assert ActivationMeter().peak() == 0 and ActivationMeter().per_sample() == 0.0


def test_meter_matches_the_planners_profiler_on_a_zoo_model():
    """The run measures what the plan predicts: the profiler's per-layer saved bytes of
    one forward, summed, are the meter's bytes for a step of the same batch."""
    from hetrain.models.zoo import build_model
    from hetrain.plan.profile import saved_bytes

    torch.manual_seed(0)
    model, batch = build_model("cnn-small"), 4
    inputs = model.example_inputs(batch, generator=torch.Generator().manual_seed(0))
    predicted = sum(saved_bytes(model, inputs, batch)) * batch
    meter = ActivationMeter(model)
    with meter.of(batch):
        model(*inputs)[0].sum().backward()
    assert predicted > 0
    assert meter.peak() == predicted
