"""The model architectures vllm-diffusion registers with vLLM: name -> import path."""

ARCHITECTURES = {
    "SDARForCausalLM": "vllm_diffusion.models.sdar:SDARForCausalLM",
    "SDARMoeForCausalLM": "vllm_diffusion.models.sdar:SDARMoeForCausalLM",
    "LLaDA2MoeModelLM": "vllm_diffusion.models.llada2:LLaDA2MoeModelLM",
    "LLaDAModelLM": "vllm_diffusion.models.llada:LLaDAModelLM",
    "DreamModel": "vllm_diffusion.models.dream:DreamModel",
    "Fast_dLLM_QwenForCausalLM": "vllm_diffusion.models.fast_dllm_v2:Fast_dLLM_QwenForCausalLM",
}
