"""LOCAL learning: Siamese model, contrastive losses, training, evaluation and export.

Importing this package does not import torch; submodules that need it import it themselves.
"""

__version__ = "0.1.0"
