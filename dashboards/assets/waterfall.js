/* The waterfall of one request, drawn in the browser from figure JSON the server sends for a
 * key (callbacks.WATERFALL_ROUTE). Pointing at a request in the breakdown for a moment fetches
 * its figure ahead, so the click that follows draws at once: no round trip on the click path
 * (bench/dashboard_render.py). Dash calls these as clientside callbacks (callbacks.register). */
(function () {
    const CACHED = 32;  // figures kept, the most recently used
    const REST_MS = 80;  // the pointer rests this long on a request before its figure is fetched
    const cache = new Map();  // key -> Promise of the figure JSON, oldest first
    let resting = null;

    function route() {
        const config = JSON.parse(document.getElementById('_dash-config').textContent);
        return config.requests_pathname_prefix + '_kvscope/waterfall?key=';
    }

    function figureOf(key) {
        let figure = cache.get(key);
        if (figure) {
            cache.delete(key);  // most recently used last
        } else {
            figure = fetch(route() + encodeURIComponent(key)).then(response => {
                if (!response.ok) {
                    throw new Error(`waterfall of ${key}: HTTP ${response.status}`);
                }
                return response.json();
            });
            figure.catch(() => cache.delete(key));  // a failed fetch is retried next time
        }
        cache.set(key, figure);
        while (cache.size > CACHED) {
            cache.delete(cache.keys().next().value);
        }
        return figure;
    }

    function keyOf(event) {  // the request a breakdown hover or click is on (its first component)
        const points = (event && event.points) || [];
        const hit = points.find(p => p.customdata);
        return hit ? hit.customdata[0] : null;
    }

    window.dash_clientside = Object.assign({}, window.dash_clientside, {
        kvscope: {
            // hoverData -> nothing: fetch the figure of the request the pointer rests on
            prefetch: function (hover) {
                clearTimeout(resting);
                const key = keyOf(hover);
                if (key) {
                    resting = setTimeout(() => figureOf(key).catch(() => {}), REST_MS);
                }
                return window.dash_clientside.no_update;
            },
            // clickData -> the request dropdown's value
            clicked: function (click) {
                const key = keyOf(click);
                return key ? key : window.dash_clientside.no_update;
            },
            // the request dropdown's value -> the waterfall's figure
            waterfall: function (key) {
                return figureOf(key || '');
            },
        },
    });
})();
