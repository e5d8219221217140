import pytest
from data_fixtures import fixture_config


@pytest.fixture
def cfg():
    return fixture_config()
