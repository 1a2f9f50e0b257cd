"""asyncslab's tests: shared helpers in ``tests.helpers``, hand-crafted malformed files in
``tests.malformed``, generated vLLM models in ``tests.engines.vllm_models``."""
