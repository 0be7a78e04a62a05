"""The CPU kernels that `kernelize` attaches compute what the plain modules compute: packed projections, products by
the fastest kernel, few-query attention, dropout masks, int8 inference of a kernelized model, bf16 training with float32
attention; and kernelizing changes neither the weights nor a saved folder."""

import copy
import json
import math

import pytest
import torch
from helpers import (
    DECODING_PATHS,
    INT8_LOGIT_RMS_TOLERANCE,
    mistranslations,
    smallest_logit_margin,
    teacher_forced_logits,
    timing_forbidden,
)
from tiny import PROBE_SENTENCES, TINY_MODEL
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
from transformers import AttentionInterface, AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, generate
from hf_vaswani.cli import main
from hf_vaswani.kernels import cpu as cpu_kernels
from hf_vaswani.kernels.cpu import (
    FEW_QUERIES,
    PACKED_KERNELS,
    PACKED_WEIGHTS,
    CheapMaskDropout,
    FastestKernelAttention,
    FastestKernelLinear,
    LinearByFastestProducts,
    fastest_packed_kernel,
    few_query_attention,
    kernelize,
    multiplying_by,
    packed,
    packed_weights,
    product,
    sdpa_or_fewer_operators,
)
from hf_vaswani.kernels.cpu_features import cpu_bf16_matmul_works
from hf_vaswani.kernels.quantization import fastest_int8_engine, process_int8_engine, quantize_int8
from hf_vaswani.model import modeling_vaswani
from hf_vaswani.model.loss_vaswani import ProjectedLabelSmoothedLoss

AVAILABLE_KERNELS = [name for name, kernel in PACKED_KERNELS.items() if kernel.available(torch.float32)]


def test_kernelize_swaps_the_plain_modules_and_changes_neither_the_weights_nor_the_saved_folder(tmp_path) -> None:
    torch.manual_seed(0)
    plain = VaswaniForConditionalGeneration(VaswaniConfig(**TINY_MODEL | {"dropout": 0.1}))
    kinds = {
        nn.Linear: FastestKernelLinear,
        nn.Dropout: CheapMaskDropout,
        modeling_vaswani.VaswaniMultiHeadAttention: FastestKernelAttention,
    }
    counts = {kind: sum(type(m) is kind for m in plain.modules()) for kind in kinds}
    model = kernelize(copy.deepcopy(plain))
    assert all(counts.values())
    assert {kind: sum(type(m) is kernel for m in model.modules()) for kind, kernel in kinds.items()} == counts
    assert not any(type(m) in kinds for m in model.modules())
    assert "generate" not in vars(model)  # kernels only: the search a call runs is not a kernel's to choose
    classes = [type(m) for m in model.modules()]
    assert kernelize(model) is model and [type(m) for m in model.modules()] == classes  # twice: nothing more
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in plain.state_dict().items())
    plain.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "kernelized")
    files = sorted(path.name for path in (tmp_path / "plain").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "kernelized").iterdir())
    for name in files:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "kernelized" / name).read_bytes(), name


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_kernelized_model_computes_what_the_plain_one_computes(attn_implementation: str) -> None:
    """Logits, the loss with and without logits, their gradients and beam search, against the plain torch.nn model,
    with whichever kernels this CPU measures fastest."""
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL)
    plain = VaswaniForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)
    model = kernelize(copy.deepcopy(plain))
    source, labels = torch.randint(4, config.vocab_size, (3, 7)), torch.randint(4, config.vocab_size, (3, 5))
    for return_logits in (True, False):
        outputs = []
        for each in (plain, model):
            each.zero_grad()
            out = each.train()(input_ids=source, labels=labels, return_logits=return_logits)
            out.loss.backward()
            outputs.append((out, [parameter.grad for parameter in each.parameters()]))
        (expected, expected_grads), (got, grads) = outputs
        torch.testing.assert_close(got.loss, expected.loss)
        if return_logits:
            torch.testing.assert_close(got.logits, expected.logits)
        for got_grad, expected_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got_grad, expected_grad)
    options = dict(num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        expected, got = (generate(each.eval(), input_ids=source, **options) for each in (plain, model))
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores)


def test_a_copy_of_a_kernelized_model_generates_with_its_own_weights() -> None:
    """A deep copy of a kernelized model (as quantize_int8 makes) decodes with its own weights, packed for it."""
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL)
    model = kernelize(VaswaniForConditionalGeneration(config)).eval()
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.mul_(-1.0)  # the tied embeddings too: another model
    reference = VaswaniForConditionalGeneration(config).eval()
    reference.load_state_dict(clone.state_dict())
    source = torch.randint(4, config.vocab_size, (2, 6))
    options = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    got, expected = generate(clone, input_ids=source, **options), reference.generate(input_ids=source, **options)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores)
    assert not torch.equal(generate(model, input_ids=source, **options).sequences_scores, got.sequences_scores)


@pytest.fixture(params=AVAILABLE_KERNELS)
def packed_kernel(request, monkeypatch) -> str:
    """Each packed kernel this torch build has, whatever this CPU's measurement decides about their speed."""
    monkeypatch.setattr(cpu_kernels, "fastest_packed_kernel", lambda *shape: request.param)
    return request.param


def test_the_kernel_is_measured_once_per_shape_dtype_and_thread_count_and_used() -> None:
    fastest_packed_kernel.cache_clear()
    layers = [FastestKernelLinear(48, 80), FastestKernelLinear(48, 80), FastestKernelLinear(80, 48)]
    layers.append(FastestKernelLinear(48, 80).to(torch.bfloat16))
    threads = torch.get_num_threads()
    with multiplying_by(packed(layers)):
        chosen = [getattr(packed_copy(layer), "kernel", None) for layer in layers]
        held = [packed_copy(layer) is not None for layer in layers]
    assert fastest_packed_kernel.cache_info().misses == 3  # two float32 shapes and one bf16, each timed once
    expected = [fastest_packed_kernel(48, 80, threads, torch.float32)] * 2
    expected += [fastest_packed_kernel(80, 48, threads, torch.float32), fastest_packed_kernel(48, 80, threads, BF16)]
    assert chosen == expected and held == [kernel is not None for kernel in expected]
    assert set(expected[:3]) <= {None, *AVAILABLE_KERNELS}
    assert expected[3] is None or PACKED_KERNELS[expected[3]].available(BF16)
    assert fastest_packed_kernel.cache_info().misses == 3
    assert all(packed_copy(layer) is None for layer in layers)


def packed_copy(layer: nn.Module):
    """The packed copy of `layer`'s weight that decoding in this thread multiplies by, or None."""
    return PACKED_WEIGHTS.get().get(layer)


BF16 = torch.bfloat16
BF16_KERNELS = [name for name, kernel in PACKED_KERNELS.items() if kernel.available(BF16)]


@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("rows", [1, 32, 256])
def test_packed_bf16_projection_equals_torch_linear_to_bf16_rounding(rows: int, kernel: str, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "fastest_packed_kernel", lambda *shape: kernel)
    torch.manual_seed(0)
    layer = FastestKernelLinear(48, 80).to(BF16)
    inputs = torch.randn(rows, 1, 48, dtype=BF16)
    with multiplying_by(packed([layer])), torch.no_grad():
        assert packed_copy(layer).kernel == kernel
        product_by_copy = layer(inputs)
    assert product_by_copy.dtype == BF16
    exact = nn.functional.linear(inputs.double(), layer.weight.double(), layer.bias.double())
    absolute_sum = inputs.double().abs() @ layer.weight.double().abs().T + layer.bias.double().abs()
    # Products of bf16 operands are exact in float32; the kernel sums them in float32 ((48 + 1) eps_32 / 2 of the
    # absolute sum, Higham 3.1) and rounds the result to bf16 (eps_bf16 / 2 of it): within that of the exact value.
    bound = ((48 + 1) * torch.finfo(torch.float32).eps + torch.finfo(BF16).eps) / 2 * absolute_sum
    error = (product_by_copy.double() - exact).abs()
    assert torch.all(error <= bound), (error / bound).max()


@pytest.mark.parametrize("rows", [1, 5, 32, 256, 300])
def test_packed_projection_equals_torch_linear(rows: int, packed_kernel: str) -> None:
    torch.manual_seed(0)
    layer = FastestKernelLinear(48, 80)
    inputs = torch.randn(rows, 1, 48)
    with multiplying_by(packed([layer])), torch.no_grad():
        assert packed_copy(layer).kernel == packed_kernel
        product_by_copy = layer(inputs)
    assert packed_copy(layer) is None  # the copy is in use for the block only
    with torch.no_grad():
        expected = nn.functional.linear(inputs, layer.weight, layer.bias)
        absolute_sum = inputs.abs() @ layer.weight.abs().T + layer.bias.abs()
    # The two kernels may sum in any order: each lands within (48 + 1) * eps / 2 * absolute_sum of the exact value
    # (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so they differ by at most twice that, on any CPU.
    bound = (layer.in_features + 1) * torch.finfo(torch.float32).eps * absolute_sum
    error = (product_by_copy - expected).abs()
    assert torch.all(error <= bound), (error / bound).max()


PRODUCT_CHOICES = [None, *(["onednn"] if torch.backends.mkldnn.is_available() else [])]


@pytest.fixture(params=PRODUCT_CHOICES)
def product_kernel(request, monkeypatch) -> str | None:
    """Each kernel `product` can choose (None: torch's own product), whatever this CPU's measurement decides."""
    monkeypatch.setattr(cpu_kernels, "PRODUCT_KERNELS", {})
    monkeypatch.setattr(cpu_kernels, "fastest", lambda products: request.param)
    return request.param


def float32_product_bound(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """How far two float32 evaluations of a @ b.T + bias may differ, in any summation order: twice Higham's
    (k + 1) eps / 2 |a| |b|^T (+ |bias|) bound on each one's error (Accuracy and Stability of Numerical Algorithms,
    3.1), with k the inner size."""
    absolute = a.abs().double() @ b.abs().double().T + (0 if bias is None else bias.abs().double())
    return (a.shape[1] + 1) * torch.finfo(torch.float32).eps * absolute


def test_linear_by_fastest_products_gives_linears_output_and_gradients(product_kernel: str | None) -> None:
    torch.manual_seed(0)
    inputs = torch.randn(3, 5, 48, requires_grad=True)
    weight, bias = torch.randn(80, 48, requires_grad=True), torch.randn(80, requires_grad=True)
    upstream = torch.randn(3, 5, 80)
    output = LinearByFastestProducts.apply(inputs, weight, bias)
    grads = torch.autograd.grad((output * upstream).sum(), (inputs, weight, bias))
    assert set(cpu_kernels.PRODUCT_KERNELS.values()) == {product_kernel}  # all three products took it
    assert len(cpu_kernels.PRODUCT_KERNELS) == 3
    rows, upstream_rows = inputs.detach().reshape(15, 48), upstream.reshape(15, 80)
    exact = [  # float64 products of the same float32 operands
        nn.functional.linear(rows.double(), weight.detach().double(), bias.detach().double()),
        upstream_rows.double() @ weight.detach().double(),
        upstream_rows.double().T @ rows.double(),
        upstream_rows.double().sum(0),
    ]
    bounds = [
        float32_product_bound(rows, weight.detach(), bias.detach()),
        float32_product_bound(upstream_rows, weight.detach().T),
        float32_product_bound(upstream_rows.T, rows.T),
        16 * torch.finfo(torch.float32).eps * upstream_rows.abs().double().sum(0),
    ]
    for got, expected, bound in zip((output.reshape(15, 80), *grads), exact, bounds, strict=True):
        assert torch.all((got.reshape(expected.shape).double() - expected).abs() <= bound)


def test_a_product_is_measured_once_per_shape_class_layout_and_thread_count(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "PRODUCT_KERNELS", {})
    measured = []
    real_fastest = cpu_kernels.fastest
    monkeypatch.setattr(cpu_kernels, "fastest", lambda products: measured.append(1) or real_fastest(products))
    a, b = torch.randn(200, 48), torch.randn(80, 48)
    expected = b.double() @ a.double().T
    for left, right in [(a, b), (a[:150], b), (a, b), (b, a), (b.T.contiguous().T, a)]:
        got = product(left, right)
        exact = left.double() @ right.double().T
        assert torch.all((got.double() - exact).abs() <= float32_product_bound(left, right))
    # (200 | 150, 48, 80) share the class (256, 64, 128); (80, 48, 200) is another; a transposed `a` another
    assert len(measured) == 3 and len(cpu_kernels.PRODUCT_KERNELS) == 3
    assert set(cpu_kernels.PRODUCT_KERNELS.values()) <= set(PRODUCT_CHOICES)
    assert torch.all((product(b, a).double() - expected).abs() <= float32_product_bound(b, a))
    product(a.double(), b.double())  # float64: torch's product, nothing measured
    assert len(measured) == 3


def attention_operands(sentences: int, queries: int, keys: int, mask: str) -> tuple:
    """query, key, value (sentences x 4 heads x length x 8) and a mask of kind `mask` as transformers makes them for
    sdpa (booleans, True where a query may attend) or an additive float mask; the boolean mask bars the first sentence
    from every key (a row that sdpa gives zeros) and the others from their last two."""
    query, key, value = (torch.randn(sentences, 4, length, 8) for length in (queries, keys, keys))
    allowed = torch.ones(sentences, 1, queries, keys, dtype=torch.bool)
    allowed[0], allowed[1:, :, :, -2:] = False, False
    masks = {"none": None, "bool": allowed, "float": torch.randn(sentences, 1, queries, keys)}
    return query, key, value, masks[mask]


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize(("queries", "keys"), [(1, 1), (1, 9), (4, 24), (FEW_QUERIES, 5)])
def test_few_query_attention_computes_torchs_scaled_dot_product_attention(queries: int, keys: int, mask: str) -> None:
    torch.manual_seed(0)
    query, key, value, attention_mask = attention_operands(3, queries, keys, mask)
    module = nn.Module()
    output, weights = few_query_attention(module, query, key, value, attention_mask, scaling=0.3)
    expected = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=0.3)
    assert weights is None and output.shape == (3, queries, 4, 8) and output.is_contiguous()
    torch.testing.assert_close(output, expected.transpose(1, 2))
    if mask == "bool":
        assert torch.all(output[0] == 0.0)


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_few_query_attention_in_bf16_is_exact_attention_to_bf16_rounding(mask: str) -> None:
    """bf16 operands attended in float64 from the same values are the reference. Rounding the scores to bf16 (their
    product and scaling: 2 x eps/2 relative each) moves every softmax weight by at most a factor exp(+-2 eps max|s|),
    rounding the weights to bf16 by eps/2 more, and the output's rounding adds eps/2 of it: within
    eps (2 max|s| + 1) max|v| of exact attention, first order, with |s| the largest score magnitude."""
    torch.manual_seed(0)
    query, key, value, attention_mask = attention_operands(3, 4, 24, mask)
    query, key, value = query.to(BF16), key.to(BF16), value.to(BF16)
    output, _ = few_query_attention(nn.Module(), query, key, value, attention_mask, scaling=0.3)
    assert output.dtype == BF16
    mask64 = attention_mask.double() if mask == "float" else attention_mask
    scores = 0.3 * query.double() @ key.double().transpose(2, 3)
    exact = nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask64, scale=0.3
    ).transpose(1, 2)
    largest_score = (scores + (mask64 if mask == "float" else 0)).abs().max().item()
    bound = torch.finfo(BF16).eps * (2 * largest_score + 1) * value.double().abs().max().item()
    assert (output.double() - exact).abs().max().item() <= bound


@pytest.fixture(params=[None, "few_query"])
def attention_kernel(request, monkeypatch) -> str | None:
    """Each kernel sdpa_or_fewer_operators can choose (None: transformers' sdpa function), whatever this CPU's
    measurement decides; other choices by timing stay torch's."""
    monkeypatch.setattr(cpu_kernels, "ATTENTION_KERNELS", {})
    monkeypatch.setattr(cpu_kernels, "fastest", lambda calls: request.param if "few_query" in calls else None)
    return request.param


def test_decoding_with_either_attention_kernel_gives_the_plain_models_beams(
    attention_kernel: str | None, monkeypatch
) -> None:
    """Beam search whose steps attend with each kernel (the kernelized model on sdpa, its default), against the plain
    model; the source has padding, so the encoder-decoder attention is masked."""
    calls = []
    monkeypatch.setattr(
        cpu_kernels, "few_query_attention", lambda *a, **k: calls.append(1) or few_query_attention(*a, **k)
    )
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL)
    plain = VaswaniForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    model = kernelize(copy.deepcopy(plain))
    source = torch.randint(4, config.vocab_size, (3, 7))
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    options = dict(num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        expected, got = (generate(each, input_ids=source, attention_mask=mask, **options) for each in (plain, model))
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores)
    # the encoder's attention over 7 positions (8: a power of two), a step's self-attention (1 query) and its
    # encoder-decoder attention (3 beams' queries together: 4) went through the choice
    assert {key[1] for key in cpu_kernels.ATTENTION_KERNELS} == {8, 1, 4}
    assert set(cpu_kernels.ATTENTION_KERNELS.values()) == {attention_kernel}
    assert bool(calls) == (attention_kernel == "few_query")


def test_attention_outside_few_query_cpu_inference_is_transformers_sdpa_and_nothing_is_timed(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "ATTENTION_KERNELS", {})
    monkeypatch.setattr(cpu_kernels, "fastest", timing_forbidden)
    torch.manual_seed(0)
    causal, not_causal = nn.Module(), nn.Module()
    causal.is_causal, not_causal.is_causal = True, False
    cases = [  # (module, queries, grad enabled, dropout, dtype)
        (not_causal, FEW_QUERIES + 1, False, 0.0, torch.float32),  # many queries
        (causal, 2, False, 0.0, torch.float32),  # a causal mask sdpa applies
        (not_causal, 1, True, 0.0, torch.float32),  # training
        (not_causal, 1, False, 0.1, torch.float32),  # dropout
        (not_causal, 1, False, 0.0, torch.float16),  # a type the few-query kernel does not take
    ]
    for module, queries, grad, dropout, dtype in cases:
        query, key, value = (x.to(dtype) for x in attention_operands(2, queries, 6, "none")[:3])
        with torch.set_grad_enabled(grad):
            got, _ = sdpa_or_fewer_operators(module, query, key, value, None, scaling=0.3, dropout=dropout)
        torch.manual_seed(1)  # the same dropout mask both times
        expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3, dropout=dropout)
        if dropout == 0.0:
            assert torch.equal(got, expected)
    assert cpu_kernels.ATTENTION_KERNELS == {}


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms for one test (as TrainingArguments' full_determinism sets it)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def test_under_deterministic_algorithms_linears_are_torchs_and_nothing_is_timed(
    deterministic_algorithms, monkeypatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "fastest", timing_forbidden)
    fastest_packed_kernel.cache_clear()
    torch.manual_seed(0)
    layer, inputs = FastestKernelLinear(48, 80), torch.randn(3, 5, 48, requires_grad=True)
    output = layer(inputs)
    grads = torch.autograd.grad(output.sum(), (inputs, layer.weight, layer.bias))
    expected = nn.functional.linear(inputs, layer.weight, layer.bias)
    expected_grads = torch.autograd.grad(expected.sum(), (inputs, layer.weight, layer.bias))
    assert torch.equal(output, expected)
    assert all(torch.equal(got, want) for got, want in zip(grads, expected_grads, strict=True))
    a, b = torch.randn(200, 48), torch.randn(80, 48)
    assert torch.equal(product(a, b), nn.functional.linear(a, b))
    assert packed([layer]) == {}
    module, (query, key, value, _) = nn.Module(), attention_operands(2, 1, 6, "none")
    module.is_causal = True
    with torch.inference_mode():
        got, _ = sdpa_or_fewer_operators(module, query, key, value, None, scaling=0.3)
        assert torch.equal(got, sdpa_attention_forward(module, query, key, value, None, scaling=0.3)[0])


def test_projected_loss_with_each_product_kernel_matches_cross_entropy(product_kernel: str | None) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight, bias = torch.randn(50, 16, requires_grad=True), torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 3] = -100
    ours, _ = ProjectedLabelSmoothedLoss.apply(hidden, weight, bias, labels, 0.1, 8, 1.0, product)
    ours_grads = torch.autograd.grad(ours, (hidden, weight, bias))
    assert set(cpu_kernels.PRODUCT_KERNELS.values()) == {product_kernel}
    leaves = [tensor.detach().double().requires_grad_() for tensor in (hidden, weight, bias)]
    reference = nn.functional.cross_entropy(
        nn.functional.linear(*leaves).flatten(0, 1), labels.flatten(), reduction="sum", label_smoothing=0.1
    )
    reference_grads = torch.autograd.grad(reference, leaves)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=0)  # float32 rounding, 20 log-softmaxes
    for got, expected in zip(ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")
@pytest.mark.parametrize("product_kernel", ["onednn"], indirect=True)  # oneDNN chosen, as where it is the fastest
def test_training_under_torch_compile_computes_the_eager_loss_and_gradients(product_kernel) -> None:
    """TrainingArguments(torch_compile=True) compiles the whole model (accelerate's TorchDynamoPlugin), the logit-free
    loss included: compiled, `product` keeps to torch's kernels even where oneDNN measured faster (inductor cannot lower
    oneDNN's op), and the loss and gradients are those of the eager model in float64."""
    torch.manual_seed(0)
    reference = VaswaniForConditionalGeneration(VaswaniConfig(**TINY_MODEL)).train()
    model = kernelize(copy.deepcopy(reference))
    reference.double()
    source, labels = torch.randint(4, 61, (3, 7)), torch.randint(4, 61, (3, 5))
    loss = torch.compile(model)(input_ids=source, labels=labels, return_logits=False).loss  # as VaswaniTrainer trains
    loss.backward()
    expected = reference(input_ids=source, labels=labels, return_logits=False).loss
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    for (name, parameter), expected_parameter in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad.double(), expected_parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_generate_after_an_in_place_weight_update_uses_the_new_weights(packed_kernel: str) -> None:
    """Fused AdamW updates weights without bumping their version: a packed copy kept across calls would go stale."""
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL)
    model = kernelize(VaswaniForConditionalGeneration(config)).eval()
    source = torch.randint(4, config.vocab_size, (2, 6))
    options = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    generate(model, input_ids=source, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    model.train()
    model(input_ids=source, labels=source).loss.backward()
    optimizer.step()
    model.eval()
    after = generate(model, input_ids=source, **options)
    fresh = VaswaniForConditionalGeneration(config).eval()  # plain: nothing packed
    fresh.load_state_dict(model.state_dict())
    expected = fresh.generate(input_ids=source, **options)
    assert torch.equal(after.sequences, expected.sequences)
    torch.testing.assert_close(after.sequences_scores, expected.sequences_scores)


def test_weights_held_packed_for_a_loop_of_searches_are_packed_once(packed_kernel: str, monkeypatch) -> None:
    """`packed_weights` packs once for many calls of the package's search (each of which would pack for itself), keeps
    the packed copies through them, drops them at its end, and the outputs are those of calls packing for
    themselves."""
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL)
    model = kernelize(VaswaniForConditionalGeneration(config)).eval()
    kernel = PACKED_KERNELS[packed_kernel]
    packed_shapes = []
    counting = kernel._replace(pack=lambda weight: packed_shapes.append(tuple(weight.shape)) or kernel.pack(weight))
    monkeypatch.setitem(PACKED_KERNELS, packed_kernel, counting)
    linears = [m for m in model.modules() if isinstance(m, FastestKernelLinear)]
    decoding_linears = [
        m for part in (model.get_decoder(), model.get_output_embeddings()) for m in part.modules() if m in linears
    ]
    sources = [torch.randint(4, config.vocab_size, (2, length)) for length in (5, 7, 4)]
    options = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        separately = [generate(model, input_ids=source, **options) for source in sources]
    assert len(packed_shapes) == len(sources) * len(decoding_linears)  # each call packs every decoding weight
    packed_shapes.clear()
    with packed_weights(model):
        assert all(packed_copy(m) is not None for m in decoding_linears)
        with torch.inference_mode():
            held = [generate(model, input_ids=source, **options) for source in sources]
        assert all(packed_copy(m) is not None for m in decoding_linears)  # generate's own block left them packed
    assert len(packed_shapes) == len(decoding_linears)
    assert all(packed_copy(m) is None for m in linears)
    for got, expected in zip(held, separately, strict=True):
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.sequences_scores, expected.sequences_scores)  # the same packed copies, the same sums


def test_dropout_drops_at_rate_p_and_keeps_the_expectation() -> None:
    torch.manual_seed(0)
    dropout = CheapMaskDropout(0.1).train()
    inputs = torch.rand(2000, 500) + 0.5
    outputs = dropout(inputs)
    dropped = outputs == 0
    n = inputs.numel()
    # binomial(n, 0.1): the fraction is 0.1 within 5 standard deviations
    assert abs(dropped.double().mean().item() - 0.1) < 5 * math.sqrt(0.1 * 0.9 / n)
    rate = round(0.1 * 2**16) / 2**16
    torch.testing.assert_close(outputs[~dropped], inputs[~dropped] / (1 - rate))
    assert abs(outputs.double().mean().item() / inputs.double().mean().item() - 1) < 5e-3  # E[dropout(x)] = x
    # fresh masks every call, and each row of the mask is independent of the others
    assert not torch.equal(dropout(inputs) == 0, dropped)
    assert torch.equal(dropout.eval()(inputs), inputs)


def test_dropout_gradient_is_the_mask_times_the_scale() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(64, 32, requires_grad=True)
    upstream = torch.randn(64, 32)
    outputs = CheapMaskDropout(0.3).train()(inputs)
    (outputs * upstream).sum().backward()
    kept = outputs != 0
    scale = 1 / (1 - round(0.3 * 2**16) / 2**16)
    torch.testing.assert_close(inputs.grad, upstream * kept * scale)


def test_int8_model_quantizes_every_projection_and_stays_close(trained_folder) -> None:
    model = kernelize(AutoModelForSeq2SeqLM.from_pretrained(trained_folder)).eval()  # as load_model_folder loads it
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    quantized = quantize_int8(model)
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert not [m for m in quantized.modules() if isinstance(m, nn.Linear)]  # none left in float
    # every projection, the output layer included, became int8; the float model is left as it was
    assert len([m for m in quantized.modules() if isinstance(m, DynamicQuantizedLinear)]) == len(projections) > 0
    assert all(type(m) is FastestKernelLinear for m in projections)
    reference, labels = teacher_forced_logits(model, tokenizer, PROBE_SENTENCES)
    int8, _ = teacher_forced_logits(quantized, tokenizer, PROBE_SENTENCES)
    # Teacher-forced along the right translations, padding left out: int8 stays within its rounding error (helpers),
    # and at every position the right next token keeps the highest logit, so no greedy choice can change.
    counted = labels != -100
    rms = (int8 - reference)[counted].pow(2).mean().sqrt().item()
    assert rms <= INT8_LOGIT_RMS_TOLERANCE, f"int8 moved the logits by {rms:.2f} in root mean square"
    assert smallest_logit_margin(quantized, tokenizer, PROBE_SENTENCES) > 0, "int8 put a wrong next token first"
    # Beam search (the evaluate command's path) is compared too: the fixture checked it on the float model, and int8
    # moves each hypothesis's score far less than separates the right ones from the rest there.
    for name, options in DECODING_PATHS.items():
        assert not mistranslations(quantized, tokenizer, PROBE_SENTENCES, **options), name


def test_int8_refuses_a_model_that_is_not_on_cpu() -> None:
    model = VaswaniForConditionalGeneration(VaswaniConfig(**TINY_MODEL)).to("meta")
    with pytest.raises(ValueError, match="int8 inference runs on CPU"):
        quantize_int8(model)


def test_evaluate_command_with_int8(tmp_path, trained_folder, capsys) -> None:
    sentences = ["red cat sun", "blue dog moon tree"]  # probe sentences: int8 translates them to their capitals (above)
    (tmp_path / "test.src").write_text("".join(f"{s}\n" for s in sentences))
    (tmp_path / "test.ref").write_text("".join(f"{s.upper()}\n" for s in sentences))
    arguments = ["evaluate", str(trained_folder), "--source", str(tmp_path / "test.src")]
    main([*arguments, "--reference", str(tmp_path / "test.ref"), "--int8"])
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100.0)


@pytest.fixture
def recording_attention() -> list[torch.dtype]:
    """An attention implementation registered with transformers ("recording_sdpa": sdpa) that records the dtype of
    each query it receives."""
    dtypes: list[torch.dtype] = []

    def recording_sdpa(module, query, *args, **kwargs):
        dtypes.append(query.dtype)
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("recording_sdpa", recording_sdpa)
    AttentionMaskInterface.register("recording_sdpa", sdpa_mask)
    return dtypes


@pytest.mark.skipif(not cpu_bf16_matmul_works(), reason="a bfloat16 matmul traps on this CPU")
@pytest.mark.parametrize("return_logits", [False, True])
def test_bf16_autocast_training_computes_the_fp32_loss_and_gradients_with_float32_attention(
    return_logits: bool, recording_attention: list[torch.dtype]
) -> None:
    torch.manual_seed(0)
    config = VaswaniConfig(**TINY_MODEL | {"vocab_size": 300})
    model = VaswaniForConditionalGeneration._from_config(config, attn_implementation="recording_sdpa")
    model = kernelize(model).train()
    source, labels = torch.randint(4, 300, (2, 6, 11))

    def loss_and_gradients(bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=source, labels=labels, return_logits=return_logits).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    fp32_loss, fp32_gradients = loss_and_gradients(bf16=False)
    recording_attention.clear()
    bf16_loss, bf16_gradients = loss_and_gradients(bf16=True)
    # 2 attentions in each of 2 decoder layers, 1 in each of 2 encoder layers, all in float32 under autocast
    assert recording_attention == [torch.float32] * 6
    # bfloat16 keeps 8 significant bits: each product's inputs are rounded by up to 2^-9, relative; over a dozen
    # layers the gradients stray by a few percent of their norm (cosine ~0.9995 over seeds), the loss (a mean) far less
    torch.testing.assert_close(bf16_loss, fp32_loss, rtol=2e-3, atol=0)
    cosine = nn.functional.cosine_similarity(bf16_gradients, fp32_gradients, dim=0)
    assert cosine > 0.995 and bf16_gradients.norm().item() == pytest.approx(fp32_gradients.norm().item(), rel=3e-2)


def test_the_plain_model_attends_in_the_autocast_dtype(recording_attention: list[torch.dtype]) -> None:
    """The control of the test above: without kernelize, attention receives autocast's bfloat16."""
    config = VaswaniConfig(**TINY_MODEL)
    model = VaswaniForConditionalGeneration._from_config(config, attn_implementation="recording_sdpa").train()
    source = torch.randint(4, config.vocab_size, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=source, labels=source)
    assert recording_attention == [torch.bfloat16] * 6


def test_the_int8_engine_is_one_torch_has_here_measured_once_per_thread_count() -> None:
    fastest_int8_engine.cache_clear()
    threads = torch.get_num_threads()
    engine = fastest_int8_engine(threads)
    assert engine in torch.backends.quantized.supported_engines
    assert fastest_int8_engine(threads) == engine and fastest_int8_engine.cache_info().misses == 1


def test_the_process_int8_engine_is_set_once_and_never_flipped_by_quantizing(monkeypatch) -> None:
    """torch's quantized engine is process-wide: the first int8 model sets it to the measured one, and no later
    quantization (another thread's among them) changes it."""
    monkeypatch.setattr(torch.backends.quantized, "engine", torch.backends.quantized.engine)  # restored after
    process_int8_engine.cache_clear()
    engines_seen = []
    model = kernelize(VaswaniForConditionalGeneration(VaswaniConfig(**TINY_MODEL))).eval()
    for _ in range(2):
        quantize_int8(model)
        engines_seen.append(torch.backends.quantized.engine)
    assert engines_seen == [fastest_int8_engine(torch.get_num_threads())] * 2
    assert process_int8_engine.cache_info().misses == 1
