"""transformers models loaded by asyncslab: ``asyncslab.transformers.from_pretrained(path or
s3://...)`` returns what ``AutoModelForCausalLM.from_pretrained`` returns, each checkpoint
tensor read straight into its slot of the model's own (fused) parameters. Importing this
module imports no transformers; calling it does. See ``docs/transformers.md``."""

from ._public import publish as _publish
from .engines._transformers import TransformersLoad as TransformersLoad
from .engines._transformers import from_pretrained as from_pretrained
from .engines._transformers import load as load
from .engines._transformers import load_pretrained as load_pretrained

__all__ = ["TransformersLoad", "from_pretrained", "load", "load_pretrained"]

_publish(globals())
