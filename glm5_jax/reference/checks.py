"""The error every argument check raises, the reference's and the ops' (glm5_jax._checks
builds on it): the reference is the executable spec, so it imports nothing of the op
layer, and the op layer takes this from here."""


def fail(op, arg, message, error=ValueError):
  """Raises `error` naming the op and the argument: "glm5_jax.<op>: <arg> <message>"."""
  raise error(f"glm5_jax.{op}: {arg} {message}")
