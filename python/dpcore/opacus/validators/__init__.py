"""``ModuleValidator`` as in ``opacus.validators``."""

from .module_validator import ModuleValidator, UnsupportedModuleError

__all__ = ["ModuleValidator", "UnsupportedModuleError"]
