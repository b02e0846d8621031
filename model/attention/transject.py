"""PLACEHOLDER being written now; replaced wholesale by the family's implementation."""

from model.attention.base import AttentionFamily
from model.attention.softmax import SoftmaxKernel

FAMILY = AttentionFamily(name="transject", description="placeholder", kernel=SoftmaxKernel)
