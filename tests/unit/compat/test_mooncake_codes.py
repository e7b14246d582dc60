"""The facade's one error mapping (kvplane exception -> Mooncake code) and the ReplicateConfig
checks, without any process."""

import pytest

from kvplane.common.errors import (
    AddressNotRegistered,
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NoSpace,
    NotFound,
    ProtocolError,
    Timeout,
    Unauthorized,
    Unavailable,
)
from kvplane.compat.mooncake_types import ReplicateConfig, SoftPinAction, check_config, code_of
from kvplane.store.errors import (
    InvalidKey,
    LeaseExpired,
    NoAvailableHandle,
    ObjectExists,
    ObjectHasLease,
    ObjectNotFound,
    ReplicaNotReady,
    TransferFail,
)

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("exc,code", [
    (ObjectNotFound(), -704), (ObjectHasLease(), -706), (ObjectExists(), -705),
    (ReplicaNotReady(), -703), (NoAvailableHandle(), -200), (InvalidKey(), -400),
    (LeaseExpired(), -707), (TransferFail(), -800),
    (InvalidArgument(), -600), (AddressNotRegistered(), -600), (Conflict(), -600),
    (NotFound(), -600), (NoSpace(), -200), (Timeout(), -901), (Unavailable(), -900),
    (ProtocolError(), -900), (Unauthorized(), -900), (KVPlaneError(), -900),
    (RuntimeError(), -1),
])
def test_code_of(exc, code):
    assert code_of(exc) == code


def test_check_config_codes():
    assert check_config(None) == 0
    cfg = ReplicateConfig()
    assert check_config(cfg) == 0
    cfg.prefer_alloc_in_same_node = True
    assert check_config(cfg, copying=True) == -600 and check_config(cfg) == 0
    cfg.replica_num = 2
    assert check_config(cfg) == -600  # same-node allocation needs one replica
    cfg = ReplicateConfig()
    cfg.soft_pin_action = SoftPinAction.ENABLE
    cfg.soft_pin_ttl_ms = 24 * 3600 * 1000
    assert check_config(cfg) == 0
    cfg.soft_pin_ttl_ms += 1
    assert check_config(cfg) == -600
    with pytest.raises(TypeError):
        check_config("not a config")
