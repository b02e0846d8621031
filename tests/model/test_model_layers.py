"""model/ is layered one way: each module imports only modules of its own layer or of the layers
below it (imports inside functions count, those under ``if TYPE_CHECKING:`` do not; the graph is
tests/project/test_import_graph.py's). The layers, bottom to top (docs/architecture.md, Layout):

    config      the typed config and the registry the config looks families up in
    primitives  norms, embeddings, orthogonal maps, the forward's cache, the step hooks
    base        the attention contract and its export hook; the ALBERT checkpoint format
    families    one file per attention family (and its kernels, its HF side)
    registry    model/attention/__init__.py, which registers the families
    model       the encoder, the heads, FLOP counts, diagnostics
    hub         releases, Hugging Face import and export, the package's entry points

A new module of model/ must be given a layer here (the test says so)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from test_import_graph import REPO, import_graph

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config", ("model.typed_config", "model.config", "model.attention.registry")),
    ("primitives", ("model.norm", "model.embeddings", "model.orthogonal", "model.orthogonal_kernels",
                    "model.forward_cache", "model.hooks", "model.orthogonal_step",
                    "model.step_hooks")),
    ("base", ("model.attention.base", "model.attention.hf_export", "model.hub.albert_names")),
    ("families", ("model.attention.*",)),
    ("registry", ("model.attention",)),
    ("model", ("model.encoder", "model.heads", "model.flops", "model.diagnostics")),
    ("hub", ("model.hub", "model.hub.*", "model")),
)  # fmt: skip
"""(layer, module patterns), bottom first; a module's layer is the first whose pattern fits."""


def layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatchcase(module, pattern) for pattern in patterns):
            return index
    return None


def test_every_module_of_model_has_a_layer():
    graph = import_graph(REPO, ("model",))
    assert len(graph) > 30  # the package was found
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, (
        f"modules of model/ with no layer in tests/model/test_model_layers.py: {missing}"
    )


def test_model_imports_only_its_own_layer_or_lower_ones():
    graph = import_graph(REPO, ("model",))
    upward = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m in sorted(graph)
        for t in sorted(graph[m])
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "imports against the layering of model/:\n" + "\n".join(upward)


def test_the_config_imports_no_family():
    """EncoderConfig finds the families' settings through the registry at parse time."""
    graph = import_graph(REPO, ("model",))
    assert graph["model.config"] <= {"model.typed_config", "model.attention.registry"}
    assert graph["model.attention.registry"] == set()
    assert graph["model.typed_config"] == set()
