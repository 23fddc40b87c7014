"""Opacus's ``opacus.utils`` names that scripts import (``batch_memory_manager``)."""
