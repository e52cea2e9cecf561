"""KServe v2's ``inference.GRPCInferenceService`` messages, built at import from this spec.

The published ``grpc_predict_v2.proto`` (KServe; Triton's ``grpc_service.proto`` uses the same
package, names and field numbers for these messages), plus the model-repository messages of
Triton's ``grpc_service.proto``, written as data and turned into a
``FileDescriptorProto``: no protoc step and no generated module pinned to one protobuf version.
tests/frontend/test_kserve_clients.py checks every field number and type against tritonclient's
compiled descriptors, so the wire format is the published one.

The answers of ``ModelInfer`` and ``ModelStreamInfer`` are written by hand (``infer_response``,
``stream_response``): the fixed fields of a model version are encoded once, and the rows go
from the engine's array into the answer's bytes in one copy, with no message object built;
tests/frontend/test_grpc_stream.py parses them back with the message classes.
"""

from __future__ import annotations

import functools

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
_T = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"bool": _T.TYPE_BOOL, "int32": _T.TYPE_INT32, "int64": _T.TYPE_INT64,
            "uint32": _T.TYPE_UINT32, "uint64": _T.TYPE_UINT64, "float": _T.TYPE_FLOAT,
            "double": _T.TYPE_DOUBLE, "string": _T.TYPE_STRING, "bytes": _T.TYPE_BYTES}
PARAMS = "map<string,InferParameter>"
CONTENTS_FIELDS = [("bool_contents", "repeated bool", 1), ("int_contents", "repeated int32", 2),
                   ("int64_contents", "repeated int64", 3), ("uint_contents", "repeated uint32", 4),
                   ("uint64_contents", "repeated uint64", 5), ("fp32_contents", "repeated float", 6),
                   ("fp64_contents", "repeated double", 7), ("bytes_contents", "repeated bytes", 8)]
TENSOR = [("name", "string", 1), ("datatype", "string", 2), ("shape", "repeated int64", 3)]
REPOSITORY_MODEL = [("repository_name", "string", 1), ("model_name", "string", 2),
                    ("parameters", "map<string,ModelRepositoryParameter>", 3)]

#: message -> fields (name, type, number); "Outer.Inner" nests; oneofs are named in ONEOFS
MESSAGES: dict[str, list[tuple[str, str, int]]] = {
    "ServerLiveRequest": [], "ServerLiveResponse": [("live", "bool", 1)],
    "ServerReadyRequest": [], "ServerReadyResponse": [("ready", "bool", 1)],
    "ModelReadyRequest": [("name", "string", 1), ("version", "string", 2)],
    "ModelReadyResponse": [("ready", "bool", 1)],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", "string", 1), ("version", "string", 2),
                               ("extensions", "repeated string", 3)],
    "ModelMetadataRequest": [("name", "string", 1), ("version", "string", 2)],
    "ModelMetadataResponse": [("name", "string", 1), ("versions", "repeated string", 2),
                              ("platform", "string", 3), ("inputs", "repeated TensorMetadata", 4),
                              ("outputs", "repeated TensorMetadata", 5)],
    "ModelMetadataResponse.TensorMetadata": TENSOR,
    "ModelInferRequest": [("model_name", "string", 1), ("model_version", "string", 2),
                          ("id", "string", 3), ("parameters", PARAMS, 4),
                          ("inputs", "repeated InferInputTensor", 5),
                          ("outputs", "repeated InferRequestedOutputTensor", 6),
                          ("raw_input_contents", "repeated bytes", 7)],
    "ModelInferRequest.InferInputTensor": [*TENSOR, ("parameters", PARAMS, 4),
                                           ("contents", "InferTensorContents", 5)],
    "ModelInferRequest.InferRequestedOutputTensor": [("name", "string", 1),
                                                     ("parameters", PARAMS, 2)],
    "ModelInferResponse": [("model_name", "string", 1), ("model_version", "string", 2),
                           ("id", "string", 3), ("parameters", PARAMS, 4),
                           ("outputs", "repeated InferOutputTensor", 5),
                           ("raw_output_contents", "repeated bytes", 6)],
    "ModelInferResponse.InferOutputTensor": [*TENSOR, ("parameters", PARAMS, 4),
                                             ("contents", "InferTensorContents", 5)],
    "ModelStreamInferResponse": [("error_message", "string", 1),
                                 ("infer_response", "ModelInferResponse", 2)],
    "InferParameter": [("bool_param", "bool", 1), ("int64_param", "int64", 2),
                       ("string_param", "string", 3), ("double_param", "double", 4),
                       ("uint64_param", "uint64", 5)],
    "InferTensorContents": CONTENTS_FIELDS,
    # the model-repository extension (Triton's grpc_service.proto)
    "RepositoryIndexRequest": [("repository_name", "string", 1), ("ready", "bool", 2)],
    "RepositoryIndexResponse": [("models", "repeated ModelIndex", 1)],
    "RepositoryIndexResponse.ModelIndex": [("name", "string", 1), ("version", "string", 2),
                                           ("state", "string", 3), ("reason", "string", 4)],
    "RepositoryModelLoadRequest": [*REPOSITORY_MODEL],
    "RepositoryModelLoadResponse": [],
    "RepositoryModelUnloadRequest": [*REPOSITORY_MODEL],
    "RepositoryModelUnloadResponse": [],
    "ModelRepositoryParameter": [("bool_param", "bool", 1), ("int64_param", "int64", 2),
                                 ("string_param", "string", 3), ("bytes_param", "bytes", 4)],
}
ONEOFS = {"InferParameter": "parameter_choice", "ModelRepositoryParameter": "parameter_choice"}
#: rpc name -> (request, response)
RPCS = {name: (f"{name}Request", f"{name}Response") for name in
        ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
         "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")}
#: bidirectional streams: rpc name -> (request, response), as Triton's grpc_service.proto has them
STREAMS = {"ModelStreamInfer": ("ModelInferRequest", "ModelStreamInferResponse")}


def _field(msg: descriptor_pb2.DescriptorProto, scope: str, name: str, kind: str,
           number: int) -> None:
    f = msg.field.add(name=name, number=number, json_name=_camel(name))
    repeated = kind.startswith("repeated ")
    kind = kind.removeprefix("repeated ")
    f.label = _T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL
    if kind.startswith("map<"):  # a map is a repeated nested XxxEntry {key = 1; value = 2}
        value = kind.removeprefix("map<string,").removesuffix(">")
        entry = msg.nested_type.add(name=_camel(name, upper=True) + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=_T.TYPE_STRING, label=_T.LABEL_OPTIONAL,
                        json_name="key")
        entry.field.add(name="value", number=2, type=_T.TYPE_MESSAGE, label=_T.LABEL_OPTIONAL,
                        type_name=f".{PACKAGE}.{value}", json_name="value")
        f.label, f.type, f.type_name = _T.LABEL_REPEATED, _T.TYPE_MESSAGE, \
            f".{PACKAGE}.{scope}.{entry.name}"
    elif kind in _SCALARS:
        f.type = _SCALARS[kind]
    else:
        f.type = _T.TYPE_MESSAGE
        nested = f"{scope}.{kind}" if f"{scope}.{kind}" in MESSAGES else kind
        f.type_name = f".{PACKAGE}.{nested}"


def _camel(name: str, upper: bool = False) -> str:
    head, *rest = name.split("_")
    out = head + "".join(p.title() for p in rest)
    return out[0].upper() + out[1:] if upper else out


def _file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="quiver_serve/grpc_predict_v2.proto",
                                            package=PACKAGE, syntax="proto3")
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full in MESSAGES:  # outer messages are listed before their nested ones
        outer, _, inner = full.partition(".")
        parent = fd.message_type if not inner else protos[outer].nested_type
        protos[full] = parent.add(name=inner or outer)
    for full, fields in MESSAGES.items():
        msg = protos[full]
        if full in ONEOFS:
            msg.oneof_decl.add(name=ONEOFS[full])
        for name, kind, number in fields:
            _field(msg, full, name, kind, number)
            if full in ONEOFS:
                msg.field[-1].oneof_index = 0
    service = fd.service.add(name=SERVICE.split(".")[-1])
    for rpc, (req, resp) in RPCS.items():
        service.method.add(name=rpc, input_type=f".{PACKAGE}.{req}",
                           output_type=f".{PACKAGE}.{resp}")
    for rpc, (req, resp) in STREAMS.items():
        service.method.add(name=rpc, input_type=f".{PACKAGE}.{req}",
                           output_type=f".{PACKAGE}.{resp}", client_streaming=True,
                           server_streaming=True)
    return fd


_POOL = descriptor_pool.DescriptorPool()
FILE = _POOL.Add(_file())


def message(name: str) -> type:
    """The message class of ``name`` (``"ModelInferRequest"``,
    ``"ModelInferRequest.InferInputTensor"``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


# --- hand-encoded answers (proto3 wire format: tag = field << 3 | wire type; 2 = length-delimited)

OUTPUT_NAME = "embeddings"


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message, packed repeated)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@functools.lru_cache(maxsize=256)
def _head(model: str, version: str) -> bytes:
    """``ModelInferResponse`` fields 1-2 (model_name, model_version) of one model version."""
    return (_delimited(1, model.encode()) if model else b"") + \
        (_delimited(2, version.encode()) if version else b"")


@functools.lru_cache(maxsize=4096)
def _output(num_rows: int, dim: int, raw_bytes: int) -> bytes:
    """Field 5 (the ``embeddings`` FP32 [num_rows, dim] output tensor) and the tag and length
    of field 6 (``raw_output_contents``), whose ``raw_bytes`` follow."""
    shape = varint(num_rows) + varint(dim)
    tensor = _delimited(1, OUTPUT_NAME.encode()) + _delimited(2, b"FP32") + _delimited(3, shape)
    return _delimited(5, tensor) + varint(6 << 3 | 2) + varint(raw_bytes)


def infer_response_parts(model: str, version: str, request_id: str,
                         rows: np.ndarray) -> tuple[list, int]:
    """A ``ModelInferResponse`` of ``rows`` (float32 [n, dim], C order) as byte parts (the rows
    are the array itself, not a copy) and their total length."""
    head = _head(model, version)
    rid = _delimited(3, request_id.encode()) if request_id else b""
    output = _output(rows.shape[0], rows.shape[1], rows.nbytes)
    return [head, rid, output, rows], len(head) + len(rid) + len(output) + rows.nbytes


def as_rows(rows: np.ndarray) -> np.ndarray:
    """The rows as little-endian float32 [n, dim], C order (a no-op for the engine's answers)."""
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return rows.reshape(rows.shape[0], -1) if rows.ndim != 2 else rows


def infer_response(model: str, version: str, request_id: str, rows: np.ndarray) -> bytes:
    """The serialised ``ModelInferResponse`` of one answer (one copy of the rows)."""
    parts, _ = infer_response_parts(model, version, request_id, as_rows(rows))
    return b"".join(parts)


def stream_response(model: str, version: str, request_id: str, rows: np.ndarray) -> bytes:
    """The serialised ``ModelStreamInferResponse`` of one answer (one copy of the rows)."""
    parts, size = infer_response_parts(model, version, request_id, as_rows(rows))
    return b"".join([varint(2 << 3 | 2), varint(size), *parts])


def stream_error(message: str, model: str, version: str, request_id: str) -> bytes:
    """A ``ModelStreamInferResponse`` carrying ``error_message`` and, in ``infer_response``,
    the request's model, version and id (so a client can tell which request failed)."""
    inner = _head(model, version) + (_delimited(3, request_id.encode()) if request_id else b"")
    return _delimited(1, message.encode()) + _delimited(2, inner)
