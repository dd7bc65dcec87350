"""/docs from this server's own files. FastAPI's own page loads Swagger UI's script and style from a CDN and its
favicon from FastAPI's site: on a machine without internet the page stays blank, and with internet it tells those
hosts who reads the docs. Here the page is FastAPI's, pointed at the copy of Swagger UI that the
swagger-ui-bundle-v2 wheel ships (5.x: it reads OpenAPI 3.1, which FastAPI writes), served under /docs/assets.
Only the three files the page loads are served, not the wheel's whole folder: its sample index.html loads a
petstore document from the internet. No token, as for /openapi.json: the docs describe the API, not a session.
"""

from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"
FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}
# validatorUrl off: Swagger UI would otherwise offer to send the document to validator.swagger.io
PARAMETERS = {"validatorUrl": None}


def install(app: FastAPI) -> None:
    """/docs and its assets on `app`, made with `docs_url=None` (so FastAPI's own page is not there)."""

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a proxy's prefix, as FastAPI's page does
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url, title=f"{app.title} - API docs",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon-32x32.png", swagger_ui_parameters=PARAMETERS)

    @app.get(ASSETS + "/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in FILES:
            raise HTTPException(404, f"no such file: {name}")
        return FileResponse(Path(swagger_ui_path) / name, media_type=FILES[name],
                            headers={"cache-control": "public, max-age=86400"})
