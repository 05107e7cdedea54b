"""The backend: which implementation serves each sublayer of the model on each device, decided
once when the model is built, and those implementations. `options` (the DSV4_* switches, read in
one place), `decision` (Backend, resolve: the per-device, per-model choice and its table), `ops`
(the named kernel ops: the one importer of dsv4.kernels), `fused/` (the sublayers' fused-kernel
implementations), `bind` (binds each sublayer of a model to its implementation), `branches` (the
captured parallel branches). Imports the model, the kernels and below; the model never imports it.
"""
