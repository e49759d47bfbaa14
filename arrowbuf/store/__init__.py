from .facade import ExperienceStore

__all__ = ["ExperienceStore"]
