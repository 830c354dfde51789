"""Parts of a model the layer map does not replace, which the data phase and the exporters still reach: the
key/value cache of attention modules (:mod:`.kv_cache`: its quantizers, their calibration, the scales the exporters
write), the query and probabilities of attention (:mod:`.attention`: the same, computed through transformers'
attention interface, the one place here that imports transformers) and the experts of mixture-of-experts blocks
(:mod:`.moe`: unfused into Linear layers, the tokens each expert saw; :mod:`.moe_calibration`: all-expert
calibration).

They sit low (above ``config``, below the pipeline and the exporters), because the pipeline's data phase attaches
and calibrates them and the exporters read them; they touch only ``torch`` modules by their structure (``k_proj``
and ``v_proj`` children, fused expert tensors). Until 0.3.0 they were ``quark_brevitas.hf.kv_cache``
and ``quark_brevitas.hf.moe``, which now forward here with a ``DeprecationWarning``. This package module imports
nothing; import the submodules.
"""
