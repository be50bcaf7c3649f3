"""The flight recorder's FastAPI application and its lifetime: follow the topics, serve the pages."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from openforge.ui.auth import CredentialMiddleware
from openforge.ui.follow import follower
from openforge.ui.index import Index
from openforge.ui.pages import UIState, load_tokenizer, router
from openforge.ui.settings import UISettings
from stream.records import RecordReader
from stream.settings import KafkaSettings
from stream.topics import TopicRegistry

__all__ = ["build_app"]

logger = logging.getLogger(__name__)


def build_app(settings: UISettings, credential: str, kafka: KafkaSettings | None = None, *,
              follow: bool = True) -> FastAPI:
    """The application: every page behind ``credential``; with ``follow``, the index follows the topics.

    Args:
        settings: The UI's settings.
        credential: What a request must present (see :mod:`openforge.ui.auth`).
        kafka: The cluster; from ``OPENFORGE_KAFKA_*`` when None.
        follow: Follow the topics into the index while serving (off for an index read as it is).
    """
    kafka = kafka or KafkaSettings()
    index = Index(settings.index_path, max_rollouts=settings.max_rollouts)
    reader = RecordReader(kafka, TopicRegistry.from_settings(kafka))
    state = UIState(settings=settings, index=index, reader=reader, text_of=load_tokenizer(settings.tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        consumer = follower(index, kafka) if follow else None
        try:
            await reader.start()
            if consumer is not None:
                await consumer.start()
                state.follower = consumer
                logger.info("following the topics into %s as consumer group %s", settings.index_path,
                            consumer.group_id)
            yield
        finally:
            if consumer is not None:
                await consumer.stop()
            await reader.stop()
            index.close()

    app = FastAPI(title="OpenForge flight recorder", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.ui = state
    app.add_middleware(CredentialMiddleware, credential=credential)
    app.include_router(router)
    return app
