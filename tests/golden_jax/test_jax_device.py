"""The JAX path's device is explicit: an accelerator where JAX has one, else the CPU; the weights
live on the device the golden names, and the note says which."""
import jax

from golden.jax_path import JaxGolden, accelerator, device_note
from twin.abi.presets import TINY


def test_accelerator_prefers_a_gpu_and_falls_back_to_the_cpu():
    d = accelerator()
    platforms = {x.platform for x in jax.devices()}
    assert d.platform == ("cpu" if platforms == {"cpu"} else next(x.platform for x in jax.devices()
                                                                   if x.platform != "cpu"))
    note = device_note(d)
    assert note.startswith(d.platform + " ") and note.endswith(f"#{d.id}")


def test_weights_live_on_the_named_device(tiny_ckpt):
    cpu = jax.devices("cpu")[0]
    jg = JaxGolden(tiny_ckpt, TINY, "device", device=cpu)
    assert jg.device == cpu
    leaves = jax.tree_util.tree_leaves((jg.model, jg.experts, jg._stacked))
    assert leaves and all(leaf.devices() == {cpu} for leaf in leaves)
    assert JaxGolden(tiny_ckpt, TINY, "device").device == accelerator()
