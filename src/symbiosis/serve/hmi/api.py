"""HMI's lifecycle over HTTP (authenticated as every endpoint; files uploaded with purpose "hmi": JSONL lines of
{"text": ...}):

    POST   /v1/hmi/domains                  {"name", "corpus_file", "alpha"?, "steps"?, "learning_rate"?,
                                             "batch_size"?, "window"?}      a domain: pre-train, then build its table
    POST   /v1/hmi/domains/{name}/versions  {"corpus_file", ...}            its next version, from the last one
    GET    /v1/hmi/domains[/{name}]                                         yours and the admin's; one with versions
    DELETE /v1/hmi/domains/{name}                                           every version (models on it then fail)
    POST   /v1/hmi/models                   {"name", "training_file", "domain"? (null: the root alone),
                                             "domain_version"?, "rank"?, "steps"?, "learning_rate"?, "batch_size"?}
    POST   /v1/hmi/models/{name}/versions   {"training_file", "steps"?}     trains the last version further
    GET    /v1/hmi/models[/{name}]   DELETE /v1/hmi/models/{name}
    POST   /v1/hmi/models/{name}/generate   {"prompt", "max_tokens"?}       greedy, PLOT + the upper layers
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from symbiosis.serve.errors import json_object
from symbiosis.serve.hmi.store import DOMAINS_TABLE, MODELS_TABLE


def router(hmi, tenant_dependency) -> APIRouter:
    api = APIRouter(prefix="/v1/hmi")
    caller = Depends(tenant_dependency)

    def routes(table: str, kind: str, create) -> None:  # a closure each: FastAPI reads defaults as parameters
        async def new(request: Request, tenant: str = caller):
            return await run_in_threadpool(create, tenant, await json_object(request))  # tokenizes the file

        async def new_version(name: str, request: Request, tenant: str = caller):
            return await run_in_threadpool(create, tenant, await json_object(request), name)

        def listing(tenant: str = caller):
            return {"object": "list", "data": hmi.listing(table, tenant)}

        def one(name: str, tenant: str = caller):
            return hmi.versions(table, tenant, name)

        def delete(name: str, tenant: str = caller):
            return hmi.delete(table, tenant, name)

        api.post(f"/{kind}", name=f"create_{kind}")(new)
        api.post(f"/{kind}/{{name}}/versions", name=f"version_{kind}")(new_version)
        api.get(f"/{kind}", name=f"list_{kind}")(listing)
        api.get(f"/{kind}/{{name}}", name=f"get_{kind}")(one)
        api.delete(f"/{kind}/{{name}}", name=f"delete_{kind}")(delete)

    routes(DOMAINS_TABLE, "domains", hmi.create_domain)
    routes(MODELS_TABLE, "models", hmi.create_model)

    @api.post("/models/{name}/generate")
    async def generate(name: str, request: Request, tenant: str = caller):
        # the prompt's lookups on a worker thread; the wait for the generator's batch on the loop, holding no thread
        tokens, answer = await run_in_threadpool(hmi.generate, tenant, name, await json_object(request))
        return answer(await asyncio.wrap_future(tokens))

    return api
