"""pdhal-vllm: a vLLM v1 KV connector that streams each layer's KV through pdhal.

Register it with vLLM by module path:

    KVTransferConfig(kv_connector="PdhalConnector",
                     kv_connector_module_path="pdhal_vllm.connector", ...)

The cache messager (one per prefill rank) is `python -m pdhal_vllm.messager`; see
docs/engines/vllm.md.
"""

__version__ = "0.1.0"
