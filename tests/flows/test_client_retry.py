"""flows.client's retry against Prefect's test server: what each UI's Retry sends, and the server's answer."""

from __future__ import annotations

import asyncio

import pytest
from prefect import flow


@flow(name="client-retry-target")
def _target() -> None:
    pass


async def _run_in(state_name: str, deployed: bool = True):
    """A flow run (of a deployment, or not) moved to `state_name` as a worker and a person would."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling, Failed, Running

    states = {"Failed": [Running(), Failed()], "Cancelling": [Running(), Cancelling()]}[state_name]
    async with get_client() as c:
        if deployed:
            dep = await c.create_deployment(flow_id=await c.create_flow(_target), name=f"client-retry-{state_name}")
            fr = await c.create_flow_run_from_deployment(dep)
        else:
            fr = await c.create_flow_run(_target)
        for s in states:
            await c.set_flow_run_state(fr.id, s, force=True)
        return fr.id


async def _latest(fid) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        fr = await c.read_flow_run(fid)
        return f"{fr.state.type.value}:{fr.state.name}"


def test_the_retry_of_a_failed_run_is_accepted_and_one_the_server_refuses_is_loud(prefect_harness):
    from flows.client import RetryRefused, main, retry_flow_run

    fid = asyncio.run(_run_in("Failed"))
    asyncio.run(retry_flow_run(fid, "classic"))
    assert asyncio.run(_latest(fid)) == "SCHEDULED:AwaitingRetry"     # no worker here: nothing moves it on
    # the classic UI's Retry is not forced: the server rejects rescheduling a run that is cancelling
    fid = asyncio.run(_run_in("Cancelling"))
    with pytest.raises(RetryRefused, match=r"answered REJECT \(Cannot transition flows that are cancelling"):
        asyncio.run(retry_flow_run(fid, "classic"))
    with pytest.raises(SystemExit, match=r"answered REJECT .*; the run was not rescheduled"):
        main(["retry", str(fid), "--ui", "classic"])
    assert asyncio.run(_latest(fid)) == "CANCELLING:Cancelling"
    # nor a run started outside a deployment, which no worker would pick up (the v2 UI's forced Retry would)
    fid = asyncio.run(_run_in("Failed", deployed=False))
    with pytest.raises(RetryRefused, match=r"answered ABORT \(Cannot reschedule a run without an associated"):
        asyncio.run(retry_flow_run(fid, "classic"))
    assert asyncio.run(_latest(fid)) == "FAILED:Failed"
    with pytest.raises(ValueError, match=r"ui='new'; valid: \['classic', 'v2'\]"):
        asyncio.run(retry_flow_run(fid, "new"))
