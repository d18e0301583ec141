"""Several models behind one server or one Python object: declared (declare.py), loaded on demand and
unloaded when idle (router.py), their memory measured (memory.py)."""
from cllm.router.declare import ModelSpec, declared_models, parse_model_flag, scan_models_dir
from cllm.router.router import ModelInfo, ModelLease, ModelNotFound, ModelStatus, ModelUnavailable, Router

__all__ = ["ModelInfo", "ModelLease", "ModelNotFound", "ModelSpec", "ModelStatus", "ModelUnavailable", "Router",
           "declared_models", "parse_model_flag", "scan_models_dir"]
