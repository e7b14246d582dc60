"""``mooncake.structured_object_store`` on kvplane: bundles, structured objects and the
DataProto helper (``kvplane.compat.mooncake_structured`` and ``mooncake_dataproto``)."""

from kvplane.compat.mooncake_dataproto import (  # noqa: F401
    MISSING,
    FieldSchema,
    LeafDecision,
    LeafSpec,
    MooncakeBundleTransfer,
    MooncakeDataProtoRef,
    NodeSpec,
    export_dataproto_ref,
    import_dataproto_ref,
    infer_structure,
    is_dataproto_ref_handle,
)
from kvplane.compat.mooncake_dataproto import (  # noqa: F401  (Mooncake's module spells them private)
    choose_leaf_codec as _choose_leaf_codec,
)
from kvplane.compat.mooncake_structured import (
    AUTO_PARALLEL_MIN_BYTES,
    DEFAULT_BUNDLE_CHUNK_BYTES,
    BundleTransferPolicy,
    MaterializeResult,
    RawDestination,
    RemoteBundleRef,
    StructuredMemberSlice,
    StructuredObjectPayload,
    StructuredObjectReadSpec,
    TensorObjectBuffer,
    export_ref,
    import_ref,
    raw_destination,
    tensor_object_buffer,
)

__all__ = ["MISSING", "AUTO_PARALLEL_MIN_BYTES", "DEFAULT_BUNDLE_CHUNK_BYTES",
           "BundleTransferPolicy", "FieldSchema", "MaterializeResult", "MooncakeBundleTransfer",
           "MooncakeDataProtoRef", "RawDestination", "RemoteBundleRef", "StructuredMemberSlice",
           "StructuredObjectPayload", "StructuredObjectReadSpec", "TensorObjectBuffer",
           "export_dataproto_ref", "export_ref", "import_dataproto_ref", "import_ref",
           "infer_structure", "is_dataproto_ref_handle", "raw_destination",
           "tensor_object_buffer"]
