"""Compressor settings that are not what they must be are ConfigErrors naming the setting."""
import pytest

from distframe.errors import ConfigError
from distframe.optimizers.compression import Int8Compressor, PowerSGDCompressor, make_compressor


@pytest.mark.parametrize("seed", [1.7, "7", None, True])
@pytest.mark.parametrize("build", [lambda s: Int8Compressor(seed=s), lambda s: PowerSGDCompressor(seed=s),
                                   lambda s: make_compressor("int8", seed=s)])
def test_a_seed_that_is_not_an_int_is_a_config_error(build, seed):
    """Before, 1.7 silently became 1, "7" became 7 and None raised a bare TypeError."""
    with pytest.raises(ConfigError, match=r"\.seed=.*use an int"):
        build(seed)
