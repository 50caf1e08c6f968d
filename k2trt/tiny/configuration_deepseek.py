"""The config class K2's config.json names in its auto_map (AutoConfig: configuration_deepseek.DeepseekV3Config).

k2trt make-tiny copies this file into the checkpoint, as K2's releases ship theirs, so transformers' AutoConfig loads
the tiny with trust_remote_code; AutoTokenizer reads the model's config first, and so does vLLM, so without it
neither gets as far as the tokenizer. k2trt's own: transformers' DeepseekV3Config (K2's architecture) under K2's
model_type, every field of config.json passed through as transformers reads it (YaRN's rope_scaling included).
It imports only transformers: the model directory is used without k2trt installed.
"""

from transformers import DeepseekV3Config as _DeepseekV3Config


class DeepseekV3Config(_DeepseekV3Config):
    model_type = "kimi_k2"
